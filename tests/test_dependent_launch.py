"""Programmatic dependent launch for every kernel of a model library (compiler.dependent_launch,
BuildOptions.dependent_launch).

Specification, read from a tiny Llama library compiled for sm_90 (no GPU needed: the CUDA source
and the lowered kernels' launch parameters):
- with the option, every kernel of every function the pass handles is launched with TVM's PDL tag
  (before the dynamic shared memory tag, which the runtime requires last), and its body calls
  `griddepcontrol.wait` exactly once, before anything touches one of its pointer arguments (only
  declarations and scalar arithmetic come before it, and in the fused decode GEMVs the 16-byte
  loads of their weight into registers), followed at once by
  `griddepcontrol.launch_dependents`; before both, in an early-triggering function whose largest
  static-shape buffer (its weight) holds L2_PREFETCH_MIN_BYTES or more, one call that starts the
  block's share of that weight streaming into L2 (the tiny library's functions all stream less than
  EARLY_TRIGGER_MAX_BYTES; one that streams more has no trigger: its exit lets the next kernel
  start); the functions it leaves alone (TIRx kernels, host functions)
  keep ordinary launches and no wait;
- without it, no kernel is tagged and no kernel waits (the tiny library's cache kernels launch
  ordinarily);
- hand-written functions: a kernel launched from a host loop, a kernel of several thread loops
  and a `launch_thread` kernel each wait once, first; a function without a kernel is untouched;
- the option is checked: a bool, CUDA sm_90 and newer only (llvm and sm_80 are refused, naming it);
- on the GPU (sm_90+), the library's logits equal the ordinary library's, bit for bit, in eager
  steps and in CUDA-graph decode steps.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import tvm
from tvm import tirx
from tvm.script import tirx as T

import tvmattn  # noqa: F401  - registers the tvmattn.* functions the library calls
from tir_kernels.build import DYN_SHARED_TAG, LAUNCH_PARAMS_ATTR, PIPELINE, _mixed_pipeline, uses_tirx_pipeline
from tir_kernels.common import PDL_TAG
from tvmattn.compiler.dependent_launch import (EARLY_TRIGGER_MAX_BYTES, L2_PREFETCH_BLOCK_BYTES, L2_PREFETCH_MIN_BYTES,
                                               chain_dependent_launches, chain_kernels, early_trigger, kernel_roots,
                                               prefetched_weight, skip_reason, static_buffer_bytes)
from tvmattn.compiler.pipeline import relax_pipeline
from tvmattn.models import BuildOptions, ModelConfig, compile_module, export_module

TARGET = "cuda:sm_90"
# one layer; head dim 64 (CUDA kernels need head_dim >= 32)
TINY = {"model_type": "llama", "hidden_size": 128, "intermediate_size": 128, "num_hidden_layers": 1,
        "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 128, "rms_norm_eps": 1e-5,
        "rope_theta": 100000.0, "tie_word_embeddings": True, "attention_bias": False}
WAIT, TRIGGER = "tvmattn_grid_dependency_wait();", "tvmattn_launch_dependents();"
L2_PREFETCH_LINE = re.compile(r"\s*tvmattn_prefetch_l2\(\(&\((\w+_ptr)\[0\]\)\), (\d+), (\d+)\);$")
PREFETCH_LINE = re.compile(r"\s*\*\(uint4\*\)\((\w+_local_ptr(?:_\d+)?) \+ \d+\) = \*\(uint4\*\)\((\w+_ptr) \+ [^;]*\);$")
_LOWERED: dict = {}


def _recording_pipeline():
    """tir_kernels' pipeline, keeping the last module it lowered (for the launch parameters)."""
    lower, finalize_host, finalize_device = _mixed_pipeline()

    @tvm.transform.module_pass(opt_level=0, name="RecordingTIRPipeline")
    def _record(mod, _ctx):
        _LOWERED["last"] = lower(mod)
        return _LOWERED["last"]

    return _record, finalize_host, finalize_device


tvm.tirx.register_tir_pipeline("tvmattn-test-recording", _recording_pipeline)


def cuda_sources(module) -> list[str]:
    """The CUDA source of every CUDA module `module` imports (at any depth)."""
    found = [module.inspect_source()] if module.kind == "cuda" else []
    for imported in module.imports:
        found += cuda_sources(imported)
    return found


def cuda_source(module) -> str:
    return "\n".join(cuda_sources(module))


class Built:
    """The PrimFuncs of a scheduled library module, compiled: `funcs` (name -> scheduled PrimFunc),
    `kernels` (kernel name -> launch parameters), `bodies` (kernel name -> CUDA source of its
    definition, from the opening parenthesis of its parameters on)."""

    def __init__(self, mod: tvm.IRModule, target: tvm.target.Target):
        self.funcs = {gv.name_hint: f for gv, f in mod.functions_items() if isinstance(f, tirx.PrimFunc)}
        self._tir = tvm.IRModule({gv: f for gv, f in mod.functions_items() if isinstance(f, tirx.PrimFunc)})
        self._target = target
        self._compiled = None

    def _compile(self) -> tuple[dict, dict]:
        """(kernels, bodies), compiled on first use (tens of seconds: the library's every kernel)."""
        if self._compiled is None:
            runtime = tvm.tirx.build(self._tir, target=tvm.target.Target(self._target, host="llvm"),
                                     pipeline="tvmattn-test-recording")
            lowered = _LOWERED.pop("last")
            kernels = {gv.name_hint: [str(t) for t in f.attrs[LAUNCH_PARAMS_ATTR]] for gv, f in lowered.functions_items()
                       if f.attrs is not None and f.attrs.get(LAUNCH_PARAMS_ATTR) is not None}
            bodies = {}
            for source in cuda_sources(runtime):
                for chunk in source.split('extern "C" __global__')[1:]:
                    if "{" in chunk.split(";")[0]:  # a definition, not a declaration
                        name = re.match(r"\s*void\s+(?:__launch_bounds__\([\d, ]+\)\s+)?(\w+)\(", chunk).group(1)
                        bodies[name] = chunk[chunk.index(name) + len(name):]
            self._compiled = kernels, bodies
        return self._compiled

    @property
    def kernels(self) -> dict:
        return self._compile()[0]

    @property
    def bodies(self) -> dict:
        return self._compile()[1]

    def owner(self, kernel: str) -> str:
        """The function a kernel was split from (`<name>_kernel`, `<name>_kernel_<n>`)."""
        return re.sub(r"_kernel(_\d+)?$", "", kernel)


def _scheduled(dependent_launch: bool):
    options = BuildOptions(target=TARGET, dtype="float16")
    mod, _ = export_module(ModelConfig.from_hf(TINY), options)
    target = options.tvm_target()
    with target:
        return relax_pipeline(target, dependent_launch=dependent_launch)(mod), target


@pytest.fixture(scope="module")
def plain() -> Built:
    """The tiny library's kernels without the option (the model pipeline's output)."""
    mod, target = _scheduled(False)
    built = Built(mod, target)
    built.module, built.target = mod, target
    return built


@pytest.fixture(scope="module")
def chained(plain) -> Built:
    """The same module through the pass: what the pipeline gives with the option, since the pass
    is its last step (test_pipeline_runs_the_pass_last)."""
    return Built(chain_dependent_launches(plain.module), plain.target)


def _pointers(body: str) -> list[str]:
    return re.findall(r"\*\s*(?:__restrict__\s+)?(\w+)\s*[,)]", body[:body.index("{")])


def test_every_kernel_waits_before_touching_memory(chained):
    handled = {name for name, f in chained.funcs.items() if skip_reason(f) is None or bool(f.attrs.get(PDL_TAG, False))}
    assert {"tvmattn_decode_paged", "tvmattn_split_rotary_append", "tvmattn_sample"} <= handled  # the cache's too
    waiting = [k for k in chained.kernels if chained.owner(k) in handled]
    assert len(waiting) >= 30 and len(chained.bodies) == len(chained.kernels)
    assert any(re.search(r"_kernel_\d+$", k) for k in waiting)  # a function of several kernels: each waits
    prefetching, l2_prefetching = set(), set()
    for kernel in waiting:
        assert bool(chained.funcs[chained.owner(kernel)].attrs[PDL_TAG]), kernel
        params = chained.kernels[kernel]
        assert params.count(PDL_TAG) == 1 and DYN_SHARED_TAG not in params[:-1], (kernel, params)
        body = chained.bodies[kernel]
        assert body.count(WAIT) == 1, kernel
        before = body[body.index("{") + 1:body.index(WAIT)]
        pointers = _pointers(body)
        # the fused decode GEMV's weight prefetch: 16-byte loads of its weight into registers
        prefetched = {m.group(2) for m in map(PREFETCH_LINE.match, before.split("\n")) if m}
        assert not prefetched or ("rms_norm_matmul" in kernel and len(prefetched) == 1
                                  and "_weight" in next(iter(prefetched))), (kernel, prefetched)
        if prefetched:
            prefetching.add(chained.owner(kernel))
        # the L2 prefetch: the first statement, one call naming the function's weight and its size
        l2 = [m for m in map(L2_PREFETCH_LINE.match, before.split("\n")) if m]
        if l2:
            weight, size = prefetched_weight(chained.funcs[chained.owner(kernel)])
            assert len(l2) == 1 and l2[0].group(1) == weight.name + "_ptr" and "_weight" in weight.name, (kernel, l2)
            assert int(l2[0].group(2)) == size >= L2_PREFETCH_MIN_BYTES and int(l2[0].group(3)) == L2_PREFETCH_BLOCK_BYTES
            loads = [line for line in before.split("\n") if PREFETCH_LINE.match(line) or L2_PREFETCH_LINE.match(line)]
            assert L2_PREFETCH_LINE.match(loads[0]), (kernel, before)  # before the loads into registers
            l2_prefetching.add(chained.owner(kernel))
        else:
            assert prefetched_weight(chained.funcs[chained.owner(kernel)]) is None, kernel
        touched = [p for p in pointers if re.search(rf"\b{p}\b", before) and p not in prefetched
                   and not (l2 and p == l2[0].group(1))]
        assert pointers and not touched, (kernel, before)
        for line in filter(str.strip, before.split("\n")):  # declarations, scalar arithmetic, the prefetches
            assert PREFETCH_LINE.match(line) or L2_PREFETCH_LINE.match(line) or re.match(
                r"\s*(extern |__shared__ |alignas\(\d+\) |__align__\(\d+\) )*[\w:<>, ]+ \w+(\[\d*\])?( = [^;\[]*)?;$",
                line), (kernel, line)
        assert body[body.index(WAIT) + len(WAIT):].lstrip().startswith(TRIGGER), kernel
    assert {"fused_rms_norm_matmul", "fused_rms_norm_matmul_swiglu"} <= prefetching, prefetching
    # the 64 KiB qkv and gate_up weights; the 32 KiB embedding, o_proj and down_proj are too small
    assert {"fused_rms_norm_matmul", "fused_rms_norm_matmul_swiglu"} <= l2_prefetching, l2_prefetching


def test_functions_the_pass_leaves_alone(chained, plain):
    """TIRx kernels and host functions: untouched, launched ordinarily, no wait."""
    skipped = {name: skip_reason(f) for name, f in plain.funcs.items() if skip_reason(f) is not None}
    assert any(uses_tirx_pipeline(chained.funcs[n]) for n in skipped) and "shape_func" in skipped
    for name, reason in skipped.items():
        assert chained.funcs[name].same_as(plain.funcs[name]), (name, reason)
    tirx_kernels = [k for k in chained.kernels if chained.owner(k) in skipped]
    assert tirx_kernels
    for kernel in tirx_kernels:
        assert PDL_TAG not in chained.kernels[kernel] and WAIT not in chained.bodies[kernel], kernel


def test_without_the_option_no_function_is_marked(plain):
    assert plain.funcs and not any(bool(f.attrs.get(PDL_TAG, False)) for f in plain.funcs.values() if f.attrs)


@pytest.mark.slow  # compiles the library's every kernel a second time
def test_without_the_option_no_kernel_waits(plain):
    assert plain.kernels and not any(bool(f.attrs.get(PDL_TAG, False)) for f in plain.funcs.values() if f.attrs)
    for kernel, params in plain.kernels.items():
        assert PDL_TAG not in params and "griddepcontrol" not in plain.bodies[kernel], kernel
    for module_source in plain.bodies.values():
        assert WAIT not in module_source and TRIGGER not in module_source


def _small_module() -> tvm.IRModule:
    """A Relax function of two kernels (an add, an exp)."""
    from tvm import relax

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((tirx.Var("n", "int64"), 64), "float16"))
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(relax.op.add(x, x))
            z = bb.emit_output(relax.op.exp(y))
        bb.emit_func_output(z)
    return bb.finalize()


def test_pipeline_runs_the_pass_last():
    """relax_pipeline(dependent_launch=True) is the pipeline without it, then the pass; a
    BuildOptions with the option compiles kernels that wait."""
    target = BuildOptions(target=TARGET, dtype="float16").tvm_target()
    with target:
        chained = relax_pipeline(target, dependent_launch=True)(_small_module())
        expected = chain_dependent_launches(relax_pipeline(target)(_small_module()))
    tvm.ir.assert_structural_equal(chained, expected)
    kernels = [f for f in chained.functions.values() if isinstance(f, tirx.PrimFunc) and kernel_roots(f.body)]
    assert kernels and all(bool(f.attrs[PDL_TAG]) for f in kernels)
    executable = compile_module(_small_module(), BuildOptions(target=TARGET, dtype="float16", dependent_launch=True))
    assert cuda_source(executable.mod).count(WAIT) == len(kernels)


@T.prim_func
def _three_launches(a: T.Buffer((4, 64), "float32"), b: T.Buffer((4, 64), "float32")):
    for bx in T.thread_binding(4, thread="blockIdx.x"):  # a kernel
        for tx in T.thread_binding(64, thread="threadIdx.x"):
            b[bx, tx] = a[bx, tx] * T.float32(2)
    for _ in range(2):  # a host loop launching the second kernel twice
        for bx in T.thread_binding(4, thread="blockIdx.x"):
            for tx in T.thread_binding(32, thread="threadIdx.x"):  # two thread loops of one kernel
                a[bx, tx] = b[bx, tx] + T.float32(1)
            for tx in T.thread_binding(32, thread="threadIdx.x"):
                a[bx, tx + 32] = b[bx, tx + 32] + T.float32(1)


@T.prim_func
def _launch_thread(a: T.Buffer((64,), "float32")):
    tx = T.launch_thread("threadIdx.x", 64)  # a thread_extent attribute, no loop
    a[tx] = a[tx] + T.float32(1)


@T.prim_func
def _host_only(a: T.Buffer((4,), "int64")):
    for i in range(4):
        a[i] = a[i] + T.int64(1)


@pytest.mark.parametrize("func, kernels", [(_three_launches, 2), (_launch_thread, 1), (_host_only, 0)],
                         ids=["loops", "launch-thread", "host-only"])
def test_each_kernel_of_a_function_waits_once(func, kernels):
    """Hand-written functions: one wait per kernel (a kernel launched in a host loop, kernels of
    several thread loops, a launch_thread kernel), as the body's first statement; a function
    without a kernel is left as it is."""
    func = func.with_attr("global_symbol", "f")
    assert len(kernel_roots(func.body)) == kernels
    chained = chain_kernels(func)
    if not kernels:
        assert chained.same_as(func) and skip_reason(func) == "launches no device kernel"
        return
    assert bool(chained.attrs[PDL_TAG]) and not func.attrs.get(PDL_TAG, False)
    runtime = tvm.tirx.build(tvm.IRModule({"f": chained}), pipeline=PIPELINE,
                             target=tvm.target.Target(BuildOptions(target=TARGET).tvm_target(), host="llvm"))
    bodies = [c[c.index("{") + 1:] for c in cuda_source(runtime).split('extern "C" __global__')[1:]
              if "{" in c.split(";")[0]]
    assert len(bodies) == kernels
    for body in bodies:
        assert body.count(WAIT) == 1 and body.lstrip().startswith(WAIT + "\n  " + TRIGGER), body


@T.prim_func
def _row_sums(w: T.Buffer((1024, 1024), "float32"), y: T.Buffer((1024,), "float32")):
    for bx in T.thread_binding(1024, thread="blockIdx.x"):  # 4 MiB of weight: a projection's size
        for tx in T.thread_binding(1, thread="threadIdx.x"):
            y[bx] = T.float32(0)
            for k in range(1024):
                y[bx] = y[bx] + w[bx, k]


@T.prim_func
def _row_sums_symbolic(a: T.handle, y: T.Buffer((1024,), "float32")):
    n = T.int64()
    w = T.match_buffer(a, (n, 1024), "float32")
    for bx in T.thread_binding(1024, thread="blockIdx.x"):
        for tx in T.thread_binding(1, thread="threadIdx.x"):
            y[bx] = T.float32(0)
            for k in range(n):
                y[bx] = y[bx] + w[k, bx]


def test_kernels_streaming_megabytes_let_dependents_start_at_exit():
    """A function whose static-shape buffers reach EARLY_TRIGGER_MAX_BYTES waits first but has no
    early trigger (its blocks' exit lets the next kernel start); a symbolic shape counts nothing."""
    assert static_buffer_bytes(_row_sums) == 1024 * 1024 * 4 + 1024 * 4 >= EARLY_TRIGGER_MAX_BYTES
    assert static_buffer_bytes(_row_sums_symbolic) == 1024 * 4 and early_trigger(_row_sums_symbolic)
    assert static_buffer_bytes(_three_launches) == 2 * 4 * 64 * 4 and early_trigger(_three_launches)
    chained = chain_kernels(_row_sums.with_attr("global_symbol", "f"))
    assert bool(chained.attrs[PDL_TAG]) and not early_trigger(chained)
    runtime = tvm.tirx.build(tvm.IRModule({"f": chained}), pipeline=PIPELINE,
                             target=tvm.target.Target(BuildOptions(target=TARGET).tvm_target(), host="llvm"))
    source = cuda_source(runtime)
    body = source[source.index("{", source.index('extern "C" __global__')) + 1:]
    # nor an L2 prefetch: its dependents' blocks start as its own exit, nothing to overlap
    assert body.lstrip().startswith(WAIT) and body.count(WAIT) == 1 and TRIGGER not in body
    assert "tvmattn_prefetch_l2" not in body


@T.prim_func
def _row_sums_small(w: T.Buffer((256, 1024), "float32"), y: T.Buffer((256,), "float32")):
    for bx in T.thread_binding(256, thread="blockIdx.x"):  # 1 MiB of weight: a small model's projection
        for tx in T.thread_binding(1, thread="threadIdx.x"):
            y[bx] = T.float32(0)
            for k in range(1024):
                y[bx] = y[bx] + w[bx, k]


@T.prim_func
def _small_rows(w: T.Buffer((8, 1024), "float32"), y: T.Buffer((8,), "float32")):
    for bx in T.thread_binding(8, thread="blockIdx.x"):
        for tx in T.thread_binding(1, thread="threadIdx.x"):
            y[bx] = T.float32(0)
            for k in range(1024):
                y[bx] = y[bx] + w[bx, k]


def test_the_prefetched_weight_is_the_largest_static_buffer():
    """The L2 prefetch takes a function's largest static-shape buffer parameter, where it holds at
    least L2_PREFETCH_MIN_BYTES; symbolic shapes count nothing."""
    weight, size = prefetched_weight(_row_sums)
    assert weight.name == "w" and size == 1024 * 1024 * 4
    assert 8 * 1024 * 4 < L2_PREFETCH_MIN_BYTES and prefetched_weight(_small_rows) is None
    assert prefetched_weight(_row_sums_symbolic) is None  # the symbolic (n, 1024) one is not counted
    body = chain_kernels(_small_rows.with_attr("global_symbol", "f")).script()
    assert "tvmattn_prefetch_l2" not in body and "tvmattn_grid_dependency_wait" in body


def test_early_triggering_kernels_prefetch_their_weight_before_the_wait():
    """A function under EARLY_TRIGGER_MAX_BYTES with a weight of at least L2_PREFETCH_MIN_BYTES:
    each kernel first starts its block's share of the weight streaming into L2, then waits, then
    lets its dependents start."""
    chained = chain_kernels(_row_sums_small.with_attr("global_symbol", "f"))
    assert early_trigger(chained)
    runtime = tvm.tirx.build(tvm.IRModule({"f": chained}), pipeline=PIPELINE,
                             target=tvm.target.Target(BuildOptions(target=TARGET).tvm_target(), host="llvm"))
    source = cuda_source(runtime)
    body = source[source.index("{", source.index('extern "C" __global__')) + 1:]
    prefetch = f"tvmattn_prefetch_l2((&(w_ptr[0])), {256 * 1024 * 4}, {L2_PREFETCH_BLOCK_BYTES});"
    assert body.lstrip().startswith(f"{prefetch}\n  {WAIT}\n  {TRIGGER}"), body[:300]
    assert "cp.async.bulk.prefetch.L2.global" in source  # the device function's instruction


def test_chain_kernels_is_idempotent_and_leaves_its_input(plain):
    func = plain.funcs["tvmattn_decode_paged"]
    once = chain_kernels(func)
    assert not func.attrs.get(PDL_TAG, False)  # the input as it was
    assert chain_kernels(once).same_as(once)  # tagged: left alone


@pytest.mark.parametrize("options, message", [
    (dict(dependent_launch=1), "dependent_launch=1 is not supported: expected a bool or None"),
    (dict(dependent_launch=True), "dependent_launch=True is not supported with target='llvm'.*sm_90 or newer"),
    (dict(target="cuda:sm_80", dtype="float16", dependent_launch=True), "target='cuda:sm_80'.*sm_90 or newer"),
])
def test_options_refuse_what_cannot_launch_dependently(options, message):
    with pytest.raises(ValueError, match=message):
        BuildOptions(**options)


def test_pipeline_refuses_other_targets():
    with pytest.raises(ValueError, match="dependent_launch=True is not supported: .* got 'llvm'"):
        relax_pipeline(tvm.target.Target("llvm"), dependent_launch=True)


def test_metadata_records_the_option():
    options = BuildOptions(target=TARGET, dtype="float16", dependent_launch=True)
    _, document = export_module(ModelConfig.from_hf(TINY), options)
    assert document["build_options"]["dependent_launch"] is True


@pytest.mark.parametrize("target, expected", [("cuda:sm_90", True), ("cuda:sm_100", True), ("cuda:sm_80", False),
                                              ("llvm", False)])
def test_the_default_is_on_wherever_the_target_takes_it(target, expected):
    options = BuildOptions(target=target, dtype="float16" if target != "llvm" else "float32")
    assert options.dependent_launch is expected
    assert BuildOptions(target=target, dtype=options.dtype, dependent_launch=False).dependent_launch is False


@pytest.mark.gpu
def test_dependent_launch_library_gives_the_ordinary_logits(tmp_path):
    """A float16 CUDA library (a tiny GGUF model) with and without the option: Generator with
    CUDA graphs and without gives the same tokens and the same logits, bit for bit (the same
    kernels, run in the same order; only their launches differ)."""
    pytest.importorskip("gguf")
    from test_weights import write_tiny_gguf

    from tir_kernels.support import PDL_MIN_SM, present_cuda_arch
    from tvmattn.build import compile_model
    from tvmattn.generate import Generator

    arch = present_cuda_arch()
    if arch is None or int(arch[3:].rstrip("a")) < PDL_MIN_SM:
        pytest.skip(f"programmatic dependent launch needs sm_{PDL_MIN_SM} or newer, this GPU is {arch}")
    gguf_path = tmp_path / "tiny.gguf"
    write_tiny_gguf(gguf_path, np.random.default_rng(7))
    libraries = {}
    for pdl in (False, True):
        libraries[pdl] = tmp_path / f"tiny-pdl{int(pdl)}.so"
        compile_model(str(gguf_path), libraries[pdl], target=f"cuda:{arch}", max_batch_size=4, log=lambda m: None,
                      dependent_launch=pdl)
    prompts = [[5, 17, 9, 3, 42], [9, 4, 10], [12, 8, 3, 3, 45, 27, 0]]
    for graph in (True, False):
        runs = {pdl: Generator(library, cuda_graph=graph) for pdl, library in libraries.items()}
        assert runs[True].session.metadata["build_options"]["dependent_launch"] is True
        for batch in (prompts[:1], prompts):
            a = runs[True].generate_tokens(batch, max_new_tokens=12, keep_logits=True)
            b = runs[False].generate_tokens(batch, max_new_tokens=12, keep_logits=True)
            assert runs[True].uses_cuda_graph == graph
            assert a.tokens == b.tokens, (graph, batch)
            for x, y in zip(a.logits, b.logits):
                np.testing.assert_array_equal(x, y, err_msg=f"cuda_graph={graph}")
        if graph:
            assert runs[True].session.graphs.replays >= 12
