"""The tensor-core matmul of a few rows (compiler.tensor_core_matmul).

Spec: `SmallBatchTensorCoreMatmul` takes exactly the projections TVM legalizes for decode_step
(`[batch_size, 1, K] x [N, K]^T` summed in the activations' dtype, then nothing, a residual add or
a float32 cast) for CUDA sm_80 and newer, and every one of a model's decode_step projections; it
leaves prefill shapes, the CPU, older GPUs, float32 operands, other epilogues and N or K that are
not multiples of 16 to the next rule (None). In a library's pipeline (the CUDA-core rule below
it) a projection's function launches the CUDA-core kernel below batch 16 and the tensor-core
kernel from 16 on: one function, two kernels; a weight the CUDA-core rule leaves (over its cap:
the LM head) runs on tensor cores at every batch. Schedules are validated at construction and
chosen per weight shape; the kernel compiles to mma.sync / ldmatrix / cp.async code for sm_90.
On the GPU it equals a float32 numpy product (+ residual) rounded as the kernel rounds, for
batches below, at and past its 16-row tiles and 64-row chunks, every epilogue, float16 and
bfloat16 and every schedule family (column blocks of 16, 32 and 64, K steps of 1 and 2, 2 to 6
stages); the pipeline's two-kernel function equals, bit for bit, the CUDA-core function below
batch 16 and the kernel from 16 on; a tiny model's library built with it
(BuildOptions.tensor_core_matmul) at batches below and past 16, eagerly and with CUDA graphs,
gives logits no further from a float32 CPU library's than the CUDA-core library's, and the same
greedy tokens but where rounding explains a different choice. norm_matmul (the fused RMSNorm +
projection, `FusedNormTensorCoreMatmul` from batch 16 on) equals numpy's op rounded as it rounds
(x * g to the dtype, the float32 sums times 1 / RMS) for every epilogue and schedule family.
"""

from __future__ import annotations

import json
import re

import ml_dtypes
import numpy as np
import pytest
import tvm
from harness import load_script

from tvmattn.compiler.pipeline import SmallBatchMatmul, small_batch_rules
from tvmattn.compiler.tensor_core_matmul import (FusedNormTensorCoreMatmul, SkinnyMatmulSchedule,
                                                 SmallBatchTensorCoreMatmul, choose_skinny_schedule, norm_matmul,
                                                 skinny_matmul,
                                                 swiglu_matmul_definition, swiglu_matmul_takes, swiglu_shaped)

CUDA = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})
RULE = SmallBatchTensorCoreMatmul()
# the host's branch of a two-kernel function (TENSOR_CORES_FROM_BATCH), as TVMScript prints it
BRANCH = r"\n    if T.tvm_thread_invariant\(batch\w* < T.int64\(16\)\):"


def legalized(n: int, k: int, epilogue: str = "none", dtype: str = "float16", seq: bool = False,
              other: bool = False) -> tvm.tirx.PrimFunc:
    """A projection as a model library's pipeline legalizes it (FuseTransposeMatmul, then TVM's
    CUDA legalize and fusion passes): x [batch_size, 1, k] times permute_dims(w [n, k]), then a
    residual add or a cast to float32; seq: x [1, seq_len, k] (a prefill); other: the epilogue
    multiplies instead of adding."""
    from tvm import relax
    from tvm.relax.backend.cuda import pipeline as backend
    from tvm.script import relax as R

    var = tvm.tirx.Var("seq_len" if seq else "batch_size", "int64")
    x_shape, o_shape = ((1, var, k), (1, var, n)) if seq else ((var, 1, k), (var, 1, n))
    x = relax.Var("x", R.Tensor(x_shape, dtype))
    w = relax.Var("w", R.Tensor((n, k), dtype))
    res = relax.Var("res", R.Tensor(o_shape, dtype))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, w, res] if epilogue == "add" else [x, w]):
        with bb.dataflow():
            y = bb.emit(relax.op.matmul(x, relax.op.permute_dims(w)))
            if epilogue == "add":
                y = bb.emit(relax.op.multiply(res, y) if other else relax.op.add(res, y))
            elif epilogue == "cast":
                y = bb.emit(relax.op.astype(y, "float32"))
            out = bb.emit_output(y)
        bb.emit_func_output(out)
    with CUDA:
        passes = [relax.transform.FuseTransposeMatmul()] + list(backend.legalize_passes(CUDA))[:-1]
        mod = tvm.transform.Sequential(passes)(bb.get())
    (func,) = [f for gv, f in mod.functions.items() if isinstance(f, tvm.tirx.PrimFunc) and "matmul" in gv.name_hint]
    return func


def test_schedules_follow_the_weight_shape():
    # SmolLM2: qkv, gate_up (few column blocks: 16 columns, more stages), down (K 1536: 128-wide
    # stages), the LM head (64-column blocks)
    assert choose_skinny_schedule(960, 576) == SkinnyMatmulSchedule(warps_n=1, warps_k=4, k_steps=1, stages=6)
    assert choose_skinny_schedule(3072, 576) == SkinnyMatmulSchedule(warps_n=1, warps_k=4, k_steps=1, stages=4)
    # (six 128-wide stages would pass the shared-memory cap: four)
    assert choose_skinny_schedule(576, 1536) == SkinnyMatmulSchedule(warps_n=1, warps_k=4, k_steps=2, stages=4)
    assert choose_skinny_schedule(49152, 576) == SkinnyMatmulSchedule(warps_n=4, warps_k=4, k_steps=1, stages=4)
    # Llama-3.2-1B's gate_up: 512 blocks of 32 columns
    assert choose_skinny_schedule(16384, 2048) == SkinnyMatmulSchedule(warps_n=2, warps_k=4, k_steps=2, stages=4)
    # K of 80 and 48: fewer warps split it
    assert choose_skinny_schedule(96, 80).block_k == 16 and choose_skinny_schedule(96, 48).block_k == 16
    assert choose_skinny_schedule(100, 64) is None and choose_skinny_schedule(96, 60) is None
    for n, k in ((960, 576), (576, 1536), (49152, 576), (16384, 2048), (2048, 8192)):
        assert choose_skinny_schedule(n, k).smem_bytes() <= 96 << 10


def test_schedule_fields_are_validated():
    with pytest.raises(ValueError, match="warps_n=3: expected 1, 2, 4 or 8"):
        SkinnyMatmulSchedule(warps_n=3)
    with pytest.raises(ValueError, match="stages=1: expected an int from 2 to 8"):
        SkinnyMatmulSchedule(stages=1)
    with pytest.raises(ValueError, match="at most 16 warps"):
        SkinnyMatmulSchedule(warps_n=8, warps_k=4)
    with pytest.raises(ValueError, match="N=48 is not a multiple of the block's 32 columns"):
        skinny_matmul(48, 64, schedule=SkinnyMatmulSchedule(warps_n=2))
    with pytest.raises(ValueError, match="K=96 is not a multiple of a stage's 64 columns"):
        skinny_matmul(64, 96, schedule=SkinnyMatmulSchedule(warps_k=4))
    with pytest.raises(ValueError, match="dtype='float32'"):
        skinny_matmul(64, 64, "float32")
    with pytest.raises(ValueError, match="epilogue='mul'"):
        skinny_matmul(64, 64, epilogue="mul")


@pytest.mark.parametrize("epilogue", ["none", "add", "cast"])
def test_rule_takes_legalized_projections(epilogue):
    original = legalized(960, 576, epilogue)
    sch = RULE.apply(original, CUDA, False)
    assert sch is not None
    func = sch.mod["main"]
    assert original.attrs and all(func.attrs[key] == value for key, value in original.attrs.items())  # kept
    assert str(func.params[-1].dtype) == ("float32" if epilogue == "cast" else "float16")


def test_sm_of_reads_targets_and_target_strings():
    """support.sm_of, which gates the rule (and dependent launch): the arch of a tvm Target or a
    target string; 0 where there is none."""
    from tir_kernels.support import DEFAULT_CUDA_ARCH, sm_of

    assert sm_of(CUDA) == 90 and sm_of(tvm.target.Target({"kind": "cuda", "arch": "sm_90a"})) == 90
    assert sm_of("cuda:sm_80") == 80 and sm_of("cuda") == int(DEFAULT_CUDA_ARCH[3:])
    assert sm_of("llvm") == 0 and sm_of(tvm.target.Target("llvm")) == 0
    assert sm_of(tvm.target.Target("cuda")) == 50  # (TVM fills in sm_50 where none is named)


def test_rule_leaves_everything_else_to_the_next_rule():
    assert RULE.apply(legalized(960, 576, seq=True), CUDA, False) is None  # a prefill
    assert RULE.apply(legalized(960, 576), tvm.target.Target("llvm"), False) is None
    assert RULE.apply(legalized(960, 576), tvm.target.Target({"kind": "cuda", "arch": "sm_75"}), False) is None
    assert RULE.apply(legalized(960, 576, dtype="float32"), CUDA, False) is None
    assert RULE.apply(legalized(960, 576, "add", other=True), CUDA, False) is None  # not a residual add
    assert RULE.apply(legalized(968, 576), CUDA, False) is None  # N not a multiple of 16
    assert RULE.apply(legalized(960, 584), CUDA, False) is None  # K not a multiple of 16
    # a schedule of the caller's that does not tile the weight (32-column blocks of 976 rows)
    assert SmallBatchTensorCoreMatmul(lambda n, k: SkinnyMatmulSchedule(warps_n=2)).apply(
        legalized(976, 576), CUDA, False) is None
    assert SmallBatchTensorCoreMatmul(lambda n, k: SkinnyMatmulSchedule(warps_n=1)).apply(
        legalized(976, 576), CUDA, False) is not None


def _tiny_llama_config(folder) -> str:
    """The path of a tiny Llama's config.json (one layer, hidden 128) written into folder."""
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
              "intermediate_size": 256, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
              "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "vocab_size": 256,
              "max_position_embeddings": 256, "tie_word_embeddings": False}
    path = folder / "config.json"
    path.write_text(json.dumps(config))
    return str(path)


def test_rule_takes_every_decode_step_projection_of_a_model(tmp_path):
    """A tiny Llama's decode_step projections, legalized by TVM's CUDA passes: qkv, o (+ residual),
    gate_up, down (+ residual) and the LM head (float32 cast): every one is taken."""
    funcs, target = load_script("bench_small_batch").decode_step_matmuls(_tiny_llama_config(tmp_path), 64)
    kinds = {}
    for name, func in funcs.items():
        sch = RULE.apply(func, target, False)
        assert sch is not None, name
        kinds[name] = str(sch.mod["main"].params[-1].dtype), len(func.params)
    assert sorted(kinds.values()) == sorted([("float16", 3)] * 2 + [("float16", 4)] * 2 + [("float32", 3)])


def test_bench_small_batch_fused_finds_the_fused_ops_of_the_batched_step(tmp_path):
    """bench_small_batch.py --fused: decode_step's fused RMSNorm + qkv and RMSNorm + gate_up + SiLU
    * mul (a library built with fused_batch_layers), each taken by the fused tensor-core rule."""
    funcs, target = load_script("bench_small_batch").decode_step_matmuls(_tiny_llama_config(tmp_path), 64, fused=True)
    assert sorted(name.rstrip("0123456789") for name in funcs) == ["fused_rms_norm_matmul",
                                                                   "fused_rms_norm_matmul_swiglu"]
    for func in funcs.values():
        assert FusedNormTensorCoreMatmul().apply(func, target, False) is not None


def test_llama_1b_projections_over_the_cuda_core_cap_run_on_tensor_cores_at_every_batch():
    """Llama-3.2-1B's decode_step (scripts/llama-3.2-1b-config.json): qkv and o_proj (under
    SmallBatchMatmul's 16 MiB) branch on the batch; gate_up, down_proj and the LM head (over it,
    which left them to dlight's Matmul rule) run on tensor cores alone."""
    from tvm.s_tir import dlight as dl

    funcs, target = load_script("bench_small_batch").decode_step_matmuls("scripts/llama-3.2-1b-config.json", 64)
    kinds = {}
    for func in funcs.values():
        with target:
            script = dl.ApplyDefaultSchedule(*small_batch_rules(True))(tvm.IRModule({"main": func}))["main"].script()
        assert "T.ptx.mma(" in script
        kinds[tuple(int(d) for d in func.params[1].shape)] = bool(re.search(BRANCH, script))
    assert kinds == {(3072, 2048): True, (2048, 2048): True, (16384, 2048): False, (2048, 8192): False,
                     (128256, 2048): False}


@pytest.mark.parametrize("epilogue", ["none", "add", "cast", "swiglu"])
def test_kernel_compiles_to_tensor_core_code_for_sm90(epilogue):
    lib = tvm.compile(tvm.IRModule({"main": skinny_matmul(576, 1536, "bfloat16", epilogue)}), target=CUDA)
    source = lib.mod.imports[0].inspect_source()
    assert "mma_sync_aligned_m16n8k16_row_col_f32_bf16_bf16_f32" in source
    assert "ldmatrix" in source and "cp_async" in source


def test_rule_takes_the_batched_swiglu_op_at_every_batch():
    """fused_decode.matmul_swiglu over the symbolic batch: replaced by the "swiglu" kernel,
    without a CUDA-core branch (there is no CUDA-core schedule of the op); a plain projection
    whose weight has as many rows is not taken for it."""
    func = swiglu_matmul_definition(1536, 576, "float16")
    rule = SmallBatchTensorCoreMatmul(below=SmallBatchMatmul())
    with CUDA:
        taken = rule.apply(func, CUDA, False).mod["main"]
        expected = skinny_matmul(1536, 576, "float16", "swiglu")
        tvm.ir.assert_structural_equal(taken.body, expected.body, map_free_vars=True)
        plain = rule.apply(legalized(3072, 576), CUDA, False).mod["main"]
        assert "sigmoid" not in plain.script() and "tvm_thread_invariant" in plain.script()
    assert swiglu_shaped(func) and not swiglu_shaped(legalized(3072, 576))
    assert swiglu_matmul_takes(1536, 576, "float16") and not swiglu_matmul_takes(1536, 576, "float32")
    assert not swiglu_matmul_takes(1000, 576, "float16")  # N not a multiple of 16


def test_bench_small_batch_sweeps_the_swiglu_op_on_tensor_cores_only():
    """scripts/bench_small_batch.py: beside decode_step's plain projections, SmolLM2's gate_up
    with SiLU * mul (1536 x 576, two weight halves); the tc variants build it, the CUDA-core
    ones have no schedule of it (None)."""
    bench = load_script("bench_small_batch")
    funcs = bench.swiglu_matmuls("scripts/smollm2-config.json")
    func = funcs["fused_matmul_swiglu"]
    assert swiglu_shaped(func) and [int(d) for d in func.params[1].shape] == [3072, 576]
    assert not any(swiglu_shaped(f) for f in bench.decode_step_matmuls("scripts/smollm2-config.json", 64)[0].values())
    for variant in ("rows", "matmul", "gemv-b8"):
        assert bench.schedule(func, CUDA, variant) is None, variant
    for variant in ("tc", "tc-n2-p4"):
        source = bench.schedule(func, CUDA, variant).mod.imports[0].inspect_source()
        assert "mma_sync_aligned_m16n8k16" in source, variant


def test_matmul_swiglu_refuses_a_weight_without_two_halves():
    from tvm import te

    from tvmattn.compiler.fused_decode import matmul_swiglu

    x, w = te.placeholder((2, 1, 64), "float16", "x"), te.placeholder((95, 64), "float16", "w")
    with pytest.raises(ValueError, match="matmul_swiglu: w has 95 rows, expected gate and up halves"):
        matmul_swiglu(x, w)


def test_the_pipeline_tries_it_before_the_cuda_core_rule():
    from tvm.s_tir import dlight as dl

    assert [type(rule) for rule in small_batch_rules()] == [SmallBatchMatmul]  # (the default: off)
    rules = small_batch_rules(tensor_cores=True)
    assert [type(rule) for rule in rules] == [SmallBatchTensorCoreMatmul, SmallBatchMatmul]
    with CUDA:
        taken = dl.ApplyDefaultSchedule(*rules)(tvm.IRModule({"main": legalized(960, 576)}))["main"].script()
        # the CUDA-core rule takes what this one leaves (N not a multiple of 16)
        left = dl.ApplyDefaultSchedule(*rules)(tvm.IRModule({"main": legalized(968, 576)}))["main"].script()
    assert "T.ptx.mma(" in taken and "T.ptx.mma(" not in left and "threadIdx" in left


def _kernels(func) -> list[tuple[int, str]]:
    """(threads per block, name) of each CUDA kernel a function compiles to."""
    lib = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target=CUDA)
    return sorted(set(re.findall(r"__launch_bounds__\((\d+)\) (\w+)\(", lib.mod.imports[0].inspect_source())))


@pytest.mark.parametrize("epilogue", ["none", "add"])
def test_in_the_pipeline_small_batches_stay_on_cuda_cores(epilogue):
    """small_batch_rules(True): one function, two kernels (CUDA cores' 32 threads, tensor cores'
    128), and the host picks by batch_size (< TENSOR_CORES_FROM_BATCH: CUDA cores)."""
    from tvm.s_tir import dlight as dl

    from tvmattn.compiler.tensor_core_matmul import TENSOR_CORES_FROM_BATCH

    with CUDA:
        func = dl.ApplyDefaultSchedule(*small_batch_rules(True))(tvm.IRModule({"main": legalized(960, 576, epilogue)}))["main"]
    script = func.script()
    assert re.search(BRANCH, script) and "T.ptx.mma(" in script
    assert [threads for threads, _ in _kernels(func)] == ["128", "32"]
    assert TENSOR_CORES_FROM_BATCH == 16


def test_weights_the_cuda_core_rule_leaves_run_on_tensor_cores_at_every_batch():
    """The LM head (over SmallBatchMatmul's 16 MiB cap, which would leave it to dlight's Matmul):
    the tensor-core kernel alone, no branch."""
    from tvm.s_tir import dlight as dl

    with CUDA:
        func = dl.ApplyDefaultSchedule(*small_batch_rules(True))(tvm.IRModule({"main": legalized(16384, 576, "cast")}))["main"]
    assert not re.search(BRANCH, func.script())
    assert [threads for threads, _ in _kernels(func)] == ["256"]
    # and a rule with no rule below, or from batch 1: tensor cores alone as well
    assert not re.search(BRANCH, RULE.apply(legalized(960, 576), CUDA, False).mod["main"].script())
    alone = SmallBatchTensorCoreMatmul(below=SmallBatchMatmul(), from_batch=1).apply(legalized(960, 576), CUDA, False)
    assert not re.search(BRANCH, alone.mod["main"].script())
    with pytest.raises(ValueError, match="from_batch=0: expected an int of at least 1"):
        SmallBatchTensorCoreMatmul(from_batch=0)


# --- the fused decode ops (RMSNorm + projection) on tensor cores

TINY_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
              "intermediate_size": 256, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
              "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "vocab_size": 256,
              "max_position_embeddings": 256, "tie_word_embeddings": False}


def fused_op(epilogue: str, n: int = 192, k: int = 128, batch=None, eps: float = 1e-5) -> tvm.tirx.PrimFunc:
    """A fused decode op as a model's export writes it (relax emit_te of compiler.fused_decode's
    te function): rms_norm_matmul (epilogue "none" / "bias") or rms_norm_matmul_swiglu ("swiglu",
    n output columns of a 2n-row weight), over x [batch, 1, k] (None: the symbolic batch_size)."""
    from tvm import relax
    from tvm.script import relax as R

    from tvmattn.compiler.fused_decode import rms_norm_matmul, rms_norm_matmul_swiglu

    rows = 2 * n if epilogue == "swiglu" else n
    x = relax.Var("x", R.Tensor((tvm.tirx.Var("batch_size", "int64") if batch is None else batch, 1, k), "float16"))
    g, w, bias = (relax.Var("g", R.Tensor((k,), "float16")), relax.Var("w", R.Tensor((rows, k), "float16")),
                  relax.Var("bias", R.Tensor((n,), "float16")))
    args = [x, g, w] + ([bias] if epilogue == "bias" else [])
    bb = relax.BlockBuilder()
    with bb.function("main", args):
        with bb.dataflow():
            te_func = rms_norm_matmul_swiglu if epilogue == "swiglu" else rms_norm_matmul
            out = bb.emit_output(bb.emit_te(te_func, *args, eps=eps))
        bb.emit_func_output(out)
    (func,) = [f for f in bb.get().functions.values() if isinstance(f, tvm.tirx.PrimFunc)]
    return func


def test_the_norm_kernel_normalizes_in_registers_on_the_plain_schedules():
    """norm_matmul streams X through the ring like the plain kernel (64 rows a block at any K):
    each A fragment's squares are summed and the fragment scaled by g before its MMAs, and the
    epilogue scales the sums by the row's 1 / RMS (read from the warps' sums' padding column)."""
    script = norm_matmul(960, 576).script()
    assert "tvmattn_sumsq2_float16" in script and "tvmattn_scale2_float16" in script
    assert "T.rsqrt(" in script and "tvm_warp_shuffle_xor" in script
    for n, k, halves in ((960, 576, 1), (1536, 576, 2), (3072, 2048, 1), (8192, 2048, 2), (960, 8192, 1)):
        schedule = choose_skinny_schedule(n, k, halves, norm=True)
        assert schedule.row_tiles == 4 and schedule.smem_bytes(halves, norm=True) <= 99 << 10, (n, k)
        assert schedule.stages == choose_skinny_schedule(n, k, halves).stages, (n, k)  # (g's slices cost no stage)
        norm_matmul(n, k, epilogue="swiglu" if halves == 2 else "none")  # (builds)
    with pytest.raises(ValueError, match="row_tiles=3: expected 1, 2 or 4"):
        SkinnyMatmulSchedule(row_tiles=3)
    with pytest.raises(ValueError, match="epilogue='add': expected one of"):
        norm_matmul(96, 64, epilogue="add")
    with pytest.raises(ValueError, match="N=100, K=576: expected multiples of 16"):
        norm_matmul(100, 576)


@pytest.mark.parametrize("epilogue", ["none", "bias", "swiglu"])
def test_fused_rule_takes_the_fused_decode_ops_of_a_decode_batch(epilogue):
    taken = FusedNormTensorCoreMatmul().apply(fused_op(epilogue), CUDA, False)
    assert taken is not None and "T.ptx.mma(" in taken.mod["main"].script()
    # the other epsilon is read from the function, and the kernel keeps it
    assert "T.float32(9.9999999999999995e-07)" in FusedNormTensorCoreMatmul().apply(
        fused_op(epilogue, eps=1e-6), CUDA, False).mod["main"].script()


def test_fused_rule_leaves_everything_else_to_the_next_rule():
    rule = FusedNormTensorCoreMatmul()
    assert rule.apply(fused_op("none", batch=1), CUDA, False) is None  # `decode`'s static batch
    assert rule.apply(legalized(192, 128), CUDA, False) is None  # a plain projection
    assert rule.apply(fused_op("none"), tvm.target.Target("llvm"), False) is None
    assert rule.apply(fused_op("none"), tvm.target.Target({"kind": "cuda", "arch": "sm_75"}), False) is None
    assert rule.apply(fused_op("none", n=200), CUDA, False) is None  # N not a multiple of 16
    assert rule.apply(fused_op("none", k=8200), CUDA, False) is None  # K not a multiple of 16
    with pytest.raises(ValueError, match="from_batch=0: expected an int of at least 1"):
        FusedNormTensorCoreMatmul(from_batch=0)


@pytest.mark.parametrize("epilogue", ["none", "swiglu"])
def test_in_the_pipeline_the_fused_ops_branch_on_the_batch(epilogue):
    """With the fused GEMV below: one function, two kernels (the GEMV's 32 threads, tensor cores'
    128), the host's branch marked thread-invariant (TVM's ThreadSync inserts the GEMV's barriers
    under it)."""
    from tvm.s_tir import dlight as dl

    from tvmattn.compiler.fused_schedules import CUDAFusedDecodeGEMV
    from tvmattn.compiler.tensor_core_matmul import TENSOR_CORES_FROM_BATCH

    gemv = CUDAFusedDecodeGEMV()
    with CUDA:
        func = dl.ApplyDefaultSchedule(FusedNormTensorCoreMatmul(below=gemv), gemv)(
            tvm.IRModule({"main": fused_op(epilogue, n=960, k=576)}))["main"]
    script = func.script()
    assert re.search(BRANCH, script) and TENSOR_CORES_FROM_BATCH == 16
    with CUDA:
        gemv_alone = dl.ApplyDefaultSchedule(gemv)(tvm.IRModule({"main": fused_op(epilogue, n=960, k=576)}))["main"]
    (gemv_threads, _), = _kernels(gemv_alone)
    assert sorted(threads for threads, _ in _kernels(func)) == sorted(["128", gemv_threads])


@pytest.mark.parametrize("epilogue", ["none", "bias", "swiglu"])
def test_norm_kernel_compiles_with_nvcc_for_sm90(epilogue, tmp_path):
    from test_pipeline import compiles_with_nvcc

    lib = tvm.compile(tvm.IRModule({"main": norm_matmul(1536, 576, "bfloat16", epilogue)}), target=CUDA)
    source = lib.mod.imports[0].inspect_source()
    assert "mma_sync_aligned_m16n8k16_row_col_f32_bf16_bf16_f32" in source and "tvmattn_scale2_bfloat16" in source
    compiles_with_nvcc(source, tmp_path)


def test_fused_batch_layers_fuse_every_batch_where_tensor_cores_take_the_fused_ops():
    from tvmattn.models import BuildOptions
    from tvmattn.models.config import model_config_from_hf
    from tvmattn.models.export import fused_on_tensor_cores

    smollm2 = model_config_from_hf(json.load(open("scripts/smollm2-config.json")))
    llama_1b = model_config_from_hf(json.load(open("scripts/llama-3.2-1b-config.json")))
    on = dict(target="cuda:sm_90", dtype="float16", fused_batch_layers=True)
    assert fused_on_tensor_cores(smollm2, BuildOptions(**on)) and fused_on_tensor_cores(llama_1b, BuildOptions(**on))
    assert not fused_on_tensor_cores(smollm2, BuildOptions(target="cuda:sm_90", dtype="float16"))  # (the default)
    assert not fused_on_tensor_cores(smollm2, BuildOptions(**{**on, "dtype": "float32"}))
    for refused in (dict(tensor_core_matmul=False), dict(target="cuda:sm_75"), dict(target="llvm", dtype="float32"),
                    dict(fused_layers=False)):
        with pytest.raises(ValueError, match="fused_batch_layers=True is not supported: it needs tensor_core_matmul"):
            BuildOptions(**{**on, **refused})
    with pytest.raises(ValueError, match="fused_batch_layers=1 is not supported: expected a bool"):
        BuildOptions(target="cuda:sm_90", dtype="float16", fused_batch_layers=1)


# (n, k, epilogue, dtype, schedule): every schedule family the chooser makes, and forced ones
GPU_CASES = [
    pytest.param(960, 576, "none", "float16", None, id="qkv-576"),
    pytest.param(576, 1536, "add", "float16", None, id="down-1536-add"),
    pytest.param(4096, 576, "cast", "float16", SkinnyMatmulSchedule(warps_n=4, warps_k=4, stages=4),
                 id="head-cast-wn4"),
    pytest.param(512, 2048, "add", "bfloat16", SkinnyMatmulSchedule(warps_n=2, warps_k=4, k_steps=2, stages=3),
                 id="bf16-wn2-ks2"),
    pytest.param(96, 80, "none", "float16", None, id="k80"),
    pytest.param(256, 256, "none", "float16", SkinnyMatmulSchedule(warps_n=1, warps_k=2, k_steps=1, stages=2),
                 id="two-stages"),
    pytest.param(1536, 576, "swiglu", "float16", None, id="gate-up-576-swiglu"),  # SmolLM2's
    pytest.param(512, 2048, "swiglu", "bfloat16", SkinnyMatmulSchedule(warps_n=2, warps_k=4, k_steps=2, stages=3),
                 id="bf16-swiglu-wn2-ks2"),
]


def _reference(x, w, res, epilogue: str, dtype: str) -> np.ndarray:
    """float32 products and sums, rounded to dtype, then the epilogue (as the kernel rounds)."""
    np_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float16
    sums = (x.astype(np.float32)[:, 0] @ w.astype(np.float32).T)[:, None, :]
    if epilogue == "swiglu":  # w = [gate; up]: silu(gate) * up of the float32 sums, rounded once
        gate, up = np.split(sums.astype(np.float64), 2, axis=-1)
        return (gate / (1 + np.exp(-gate)) * up).astype(np_dtype).astype(np.float32)
    total = sums.astype(np_dtype)
    if epilogue == "add":
        return (res.astype(np.float32) + total.astype(np.float32)).astype(np_dtype).astype(np.float32)
    return total.astype(np.float32)


def _check_on_gpu(lib, n: int, k: int, epilogue: str, dtype: str, batches):
    """lib["main"] against _reference at each batch, and the row past the batch left alone. The
    sums in float32 may differ from the reference by an ulp of the rounded sum."""
    np_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float16
    dev = tvm.cuda(0)
    for batch in batches:
        rng = np.random.default_rng(batch)
        x = (rng.standard_normal((batch, 1, k)) * 0.5).astype(np_dtype)
        w = (rng.standard_normal((2 * n if epilogue == "swiglu" else n, k)) * 0.5).astype(np_dtype)
        res = (rng.standard_normal((batch, 1, n)) * 0.5).astype(np_dtype)
        args = [tvm.runtime.tensor(x, dev), tvm.runtime.tensor(w, dev)]
        if epilogue == "add":
            args.append(tvm.runtime.tensor(res, dev))
        out_dtype = np.float32 if epilogue == "cast" else np_dtype
        # one row past the batch: the kernel writes none of it
        out = tvm.runtime.tensor(np.full((batch + 1, 1, n), 7, out_dtype), dev)
        lib["main"](*args, out._create_view((batch, 1, n), str(np.dtype(out_dtype)) if out_dtype != ml_dtypes.bfloat16
                                             else "bfloat16", 0))
        _assert_within(out.numpy().astype(np.float32), _reference(x, w, res, epilogue, dtype), batch, dtype, ulps=2)


def _assert_within(got: np.ndarray, expected: np.ndarray, batch: int, dtype: str, ulps: int) -> None:
    """got's first `batch` rows within `ulps` ulps of the dtype of expected (+ 1, for sums near
    zero), and its row past the batch still the 7s it was filled with."""
    ulp = 2.0 ** (-7 if dtype == "bfloat16" else -10)
    bad = np.abs(got[:batch] - expected) > ulps * ulp * (np.abs(expected) + 1)
    assert not bad.any(), f"batch {batch}: {bad.sum()} of {bad.size} outside, first at {np.argwhere(bad)[0]}"
    assert (got[batch] == 7).all(), f"batch {batch}: a row past the batch was written"


@pytest.mark.gpu
@pytest.mark.parametrize("n, k, epilogue, dtype, schedule", GPU_CASES)
def test_kernel_matches_numpy_on_the_gpu(n, k, epilogue, dtype, schedule):
    lib = tvm.compile(tvm.IRModule({"main": skinny_matmul(n, k, dtype, epilogue, schedule)}), target=CUDA)
    _check_on_gpu(lib, n, k, epilogue, dtype, (1, 2, 15, 16, 17, 63, 64, 65, 130, 256))


@pytest.mark.gpu
@pytest.mark.parametrize("epilogue", ["none", "add"])
def test_the_pipelines_function_runs_each_kernel_on_its_side_of_the_branch(epilogue):
    """small_batch_rules(True)'s function equals, bit for bit, the CUDA-core rule's function below
    batch 16 and the tensor-core kernel from 16 on (so each side runs the kernel it names)."""
    from tvm.s_tir import dlight as dl

    from tvmattn.compiler.tensor_core_matmul import TENSOR_CORES_FROM_BATCH

    def build(*rules):
        with CUDA:
            func = dl.ApplyDefaultSchedule(*rules)(tvm.IRModule({"main": legalized(960, 576, epilogue)}))["main"]
        return tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target=CUDA)["main"]

    both, cuda_cores = build(*small_batch_rules(True)), build(SmallBatchMatmul())
    tensor_cores = tvm.compile(tvm.IRModule({"main": skinny_matmul(960, 576, "float16", epilogue)}), target=CUDA)["main"]
    dev = tvm.cuda(0)
    for batch in (1, 3, 15, 16, 17, 64):
        rng = np.random.default_rng(batch)
        inputs = [(rng.standard_normal((batch, 1, 576)) * 0.5).astype(np.float16),
                  (rng.standard_normal((960, 576)) * 0.5).astype(np.float16)]
        if epilogue == "add":
            inputs.append((rng.standard_normal((batch, 1, 960)) * 0.5).astype(np.float16))
        outputs = []
        for function in (both, cuda_cores if batch < TENSOR_CORES_FROM_BATCH else tensor_cores):
            out = tvm.runtime.tensor(np.zeros((batch, 1, 960), np.float16), dev)
            function(*[tvm.runtime.tensor(a, dev) for a in inputs], out)
            outputs.append(out.numpy())
        np.testing.assert_array_equal(outputs[0], outputs[1], err_msg=f"batch {batch}")


NORM_GPU_CASES = [
    pytest.param(960, 576, "none", "float16", None, id="qkv-576"),
    pytest.param(1536, 576, "swiglu", "bfloat16", None, id="gate-up-576-bf16"),
    pytest.param(512, 2048, "bias", "float16", SkinnyMatmulSchedule(warps_n=2, warps_k=4, k_steps=2, stages=3,
                                                                    row_tiles=2), id="bias-2048-rt2"),
    pytest.param(256, 256, "swiglu", "float16", SkinnyMatmulSchedule(warps_n=1, warps_k=2, k_steps=1, stages=2,
                                                                     row_tiles=1), id="swiglu-rt1-two-stages"),
]


def _norm_reference(x, g, w, bias, epilogue: str, dtype: str, eps: float, scale_last: bool = False) -> np.ndarray:
    """fused_decode's ops in numpy: h = (rstd * x) * g in float32, rounded to dtype; its float32
    products with w; rounded (+ bias in float32), or silu(gate) * up in float32, rounded once.
    scale_last: as norm_matmul rounds, h = x * g rounded to dtype, the products times rstd."""
    np_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float16
    xf = x.astype(np.float32)[:, 0]
    rstd = 1 / np.sqrt((xf * xf).sum(-1, keepdims=True) / x.shape[-1] + np.float32(eps))
    if scale_last:
        total = ((xf * g.astype(np.float32)).astype(np_dtype).astype(np.float32) @ w.astype(np.float32).T) * rstd
    else:
        total = (rstd * xf * g.astype(np.float32)).astype(np_dtype).astype(np.float32) @ w.astype(np.float32).T
    if epilogue == "swiglu":
        gate, up = np.split(total, 2, axis=-1)
        total = gate / (1 + np.exp(-gate)) * up
    elif epilogue == "bias":
        total = total + bias.astype(np.float32)
    return total[:, None, :].astype(np_dtype).astype(np.float32)


def _check_norm_on_gpu(function, n: int, k: int, epilogue: str, dtype: str, batches, eps: float = 1e-5,
                       scale_last_from: int = 1):
    """function (x, g, w[, bias], y) against _norm_reference (scale_last from batch
    scale_last_from on: norm_matmul's rounding), and the row past the batch left alone. The
    kernel's float32 sums (of squares and of products) may differ from numpy's by their order."""
    np_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float16
    dev = tvm.cuda(0)
    rows = 2 * n if epilogue == "swiglu" else n
    for batch in batches:
        rng = np.random.default_rng(batch)
        x = (rng.standard_normal((batch, 1, k)) * 3).astype(np_dtype)
        g = (1 + rng.standard_normal(k) * 0.2).astype(np_dtype)
        w = (rng.standard_normal((rows, k)) * 0.1).astype(np_dtype)
        bias = (rng.standard_normal(n) * 0.5).astype(np_dtype)
        args = [tvm.runtime.tensor(a, dev) for a in (x, g, w)]
        if epilogue == "bias":
            args.append(tvm.runtime.tensor(bias, dev))
        out = tvm.runtime.tensor(np.full((batch + 1, 1, n), 7, np_dtype), dev)
        function(*args, out._create_view((batch, 1, n), dtype, 0))
        expected = _norm_reference(x, g, w, bias, epilogue, dtype, eps, scale_last=batch >= scale_last_from)
        _assert_within(out.numpy().astype(np.float32), expected, batch,
                       dtype, ulps=4)


@pytest.mark.gpu
@pytest.mark.parametrize("n, k, epilogue, dtype, schedule", NORM_GPU_CASES)
def test_norm_kernel_matches_numpy_on_the_gpu(n, k, epilogue, dtype, schedule):
    lib = tvm.compile(tvm.IRModule({"main": norm_matmul(n, k, dtype, epilogue, 1e-5, schedule)}), target=CUDA)
    _check_norm_on_gpu(lib["main"], n, k, epilogue, dtype, (1, 2, 15, 16, 17, 33, 64, 65, 130, 256))


@pytest.mark.gpu
@pytest.mark.parametrize("epilogue", ["none", "swiglu"])
def test_the_pipelines_fused_function_runs_each_kernel_on_its_side_of_the_branch(epilogue):
    """FusedNormTensorCoreMatmul over the fused GEMV: bit for bit the GEMV's function below batch 16
    and norm_matmul's kernel from 16 on; both within numpy's rounding of the op."""
    from tvm.s_tir import dlight as dl

    from tvmattn.compiler.fused_schedules import CUDAFusedDecodeGEMV
    from tvmattn.compiler.tensor_core_matmul import TENSOR_CORES_FROM_BATCH

    n, k = (1536, 576) if epilogue == "swiglu" else (960, 576)

    def build(*rules):
        with CUDA:
            func = dl.ApplyDefaultSchedule(*rules)(tvm.IRModule({"main": fused_op(epilogue, n, k)}))["main"]
        return tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target=CUDA)["main"]

    gemv = CUDAFusedDecodeGEMV()
    both, below = build(FusedNormTensorCoreMatmul(below=gemv), gemv), build(gemv)
    tensor_cores = tvm.compile(tvm.IRModule({"main": norm_matmul(n, k, "float16", epilogue)}), target=CUDA)["main"]
    _check_norm_on_gpu(both, n, k, epilogue, "float16", (1, 3, 15, 16, 17, 64), scale_last_from=TENSOR_CORES_FROM_BATCH)
    dev = tvm.cuda(0)
    rows = 2 * n if epilogue == "swiglu" else n
    for batch in (1, 3, 15, 16, 17, 64):
        rng = np.random.default_rng(batch)
        inputs = [(rng.standard_normal((batch, 1, k)) * 3).astype(np.float16),
                  (1 + rng.standard_normal(k) * 0.2).astype(np.float16),
                  (rng.standard_normal((rows, k)) * 0.1).astype(np.float16)]
        outputs = []
        for function in (both, below if batch < TENSOR_CORES_FROM_BATCH else tensor_cores):
            out = tvm.runtime.tensor(np.zeros((batch, 1, n), np.float16), dev)
            function(*[tvm.runtime.tensor(a, dev) for a in inputs], out)
            outputs.append(out.numpy())
        np.testing.assert_array_equal(outputs[0], outputs[1], err_msg=f"batch {batch}")


@pytest.fixture(scope="module")
def tiny_libraries(tmp_path_factory):
    """A tiny GGUF model compiled for CUDA twice: decode_step's projections on CUDA cores (the
    default, False) and with the tensor-core kernel (True: its qkv, o, gate_up and down, N and K
    multiples of 16, from batch 16 on; the LM head's 268 rows are not, and stay on CUDA cores);
    and for the CPU in float32 ("reference")."""
    pytest.importorskip("gguf")
    from test_weights import write_tiny_gguf

    from tvmattn.build import compile_model, resolve_target

    folder = tmp_path_factory.mktemp("tiny-tc")
    write_tiny_gguf(folder / "tiny.gguf", np.random.default_rng(11))
    libraries = {}
    for tensor_cores in (False, True):
        libraries[tensor_cores] = folder / f"tiny-{int(tensor_cores)}.so"
        compile_model(str(folder / "tiny.gguf"), libraries[tensor_cores], target=resolve_target("cuda"),
                      max_batch_size=24, tensor_core_matmul=tensor_cores, log=lambda m: None)
    libraries["reference"] = folder / "tiny-cpu.so"
    compile_model(str(folder / "tiny.gguf"), libraries["reference"], target="llvm", dtype="float32",
                  quantization="f32", max_batch_size=24, log=lambda m: None)
    return libraries


def _error_to(result, reference) -> float:
    """Largest |logit - reference logit| of a generation, over each prompt's steps up to the first
    token the two chose differently (after it their contexts differ)."""
    error = 0.0
    for tokens, logits, ref_tokens, ref_logits in zip(result.tokens, result.logits, reference.tokens,
                                                      reference.logits):
        rows = next((j + 1 for j, (x, y) in enumerate(zip(tokens, ref_tokens)) if x != y), len(tokens))
        error = max(error, float(np.abs(logits[:rows] - ref_logits[:rows]).max()))
    return error


@pytest.mark.gpu
@pytest.mark.parametrize("cuda_graph", [False, True], ids=["eager", "graphs"])
def test_a_library_with_it_generates_the_default_librarys_tokens(tiny_libraries, cuda_graph):
    """Batches of 1, 3 and 20 prompts (batch_decode eagerly; CUDA graphs of batch buckets), so
    both of the projections' kernels run (CUDA cores below batch 16): logits no further from a
    float32 CPU library's than the CUDA-core library's (the products sum in float32 on tensor
    cores, not float16), and its greedy tokens, but where the CUDA-core library's logits held a
    near-tie: where the two first choose differently, the CUDA-core library's margin between the
    two tokens is at most twice the two libraries' errors to the float32 library."""
    from tvmattn.generate import Generator

    plain, tensor_cores = (Generator(tiny_libraries[t], cuda_graph=cuda_graph) for t in (False, True))
    reference = Generator(tiny_libraries["reference"])
    rng = np.random.default_rng(3)
    prompts = [[5, 17, 9, 3, 42], [9, 4, 10], [12, 8, 3, 3, 45, 27, 0]]
    prompts += [[int(t) for t in rng.integers(0, 200, size=int(rng.integers(1, 9)))] for _ in range(17)]
    for batch in (prompts[:1], prompts[:3], prompts):
        a = plain.generate_tokens(batch, max_new_tokens=10, keep_logits=True)
        b = tensor_cores.generate_tokens(batch, max_new_tokens=10, keep_logits=True)
        ref = reference.generate_tokens(batch, max_new_tokens=10, keep_logits=True)
        error_a, error_b = _error_to(a, ref), _error_to(b, ref)
        assert error_b <= error_a, (len(batch), error_b, error_a)
        for prompt, (tokens_a, tokens_b, logits_a) in enumerate(zip(a.tokens, b.tokens, a.logits)):
            step = next((j for j, (x, y) in enumerate(zip(tokens_a, tokens_b)) if x != y), None)
            if step is not None:
                gap = float(logits_a[step][tokens_a[step]] - logits_a[step][tokens_b[step]])
                # (each library's logits within its error of the float32 ones: a margin the other
                # library's choice overturned is at most twice the two errors)
                assert gap <= 2 * (error_a + error_b), (len(batch), prompt, step, gap, error_a, error_b)


def test_a_library_with_it_compiles_as_one_cuda_source(tmp_path):
    """A tiny Llama library with the kernel: its kernels share one CUDA source, in which each
    dynamic shared array keeps one type (the kernel's float buffer once collided with the
    prefill's half `smem`, which NVRTC refused), and nvcc compiles it (where present)."""
    import re

    from test_pipeline import compiles_with_nvcc

    from tvmattn.models import BuildOptions, compile_module, export_module
    from tvmattn.models.config import model_config_from_hf

    hf = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 96,
          "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_act": "silu",
          "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "vocab_size": 128, "max_position_embeddings": 256,
          "tie_word_embeddings": True}
    options = BuildOptions(target="cuda:sm_90", dtype="float16", max_batch_size=8, tensor_core_matmul=True)
    mod, _ = export_module(model_config_from_hf(hf), options)
    modules, sources = [compile_module(mod, options).mod], []
    while modules:  # (the CUDA module sits below the host module's imports)
        module = modules.pop()
        modules += list(module.imports)
        if module.kind == "cuda":
            sources.append(module.inspect_source())
    (source,) = sources
    assert "mma_sync_aligned_m16n8k16" in source
    arrays = set(re.findall(r"extern __shared__ __align__\(\d+\) (\w+) (\w+)\[\]", source))
    names = [name for _, name in arrays]
    assert len(names) == len(set(names)), sorted(arrays)
    compiles_with_nvcc(source, tmp_path)
