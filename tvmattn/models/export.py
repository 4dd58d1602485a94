"""Build a model library: export the decoder's functions (MLC-LLM style, weights packed as the
last argument), attach `_metadata`, compile for a target and write the shared library.

Exported functions (`vm[name]`):
- `embed(input_ids [n] int32, params) -> [n, hidden]`
- `prefill(input_embed [1, n, hidden], cache, params) -> (logits [1, 1, vocab] f32, cache)`
- `decode(input_embed [1, 1, hidden], cache, params) -> (logits [1, 1, vocab] f32, cache)`
- `batch_prefill(input_embeds [1, n, hidden], logit_positions [k] int32, cache, params)
   -> (logits [1, k, vocab] f32, cache)`
- `batch_decode(input_embeds [b, 1, hidden], cache, params) -> (logits [b, 1, vocab] f32, cache)`
- `decode_step(input_ids [b] int32, cache, params) -> (logits [b, 1, vocab] f32, cache)`: a whole
   decode step from token ids; on CUDA its intermediates live in storage allocated once per VM
   (b <= max_batch_size), so a CUDA graph can capture it (tvmattn.runtime.graphs)
- `batch_verify(input_embeds [1, n, hidden], cache, params) -> (logits [1, n, vocab] f32, cache)`:
   every node of the step's token trees (begin_forward got token_tree_parent_ptr), for
   speculative decoding
- `create_paged_kv_cache(max_batch_size, max_total_seq_len, prefill_chunk_size, page_size,
   support_sliding_window) -> cache` (ShapeTuple([value]) each, as MLC-LLM passes them)
- `sample(logits [rows, vocab] f32, params [rows, 4] f32) -> tokens [rows] int32`: one token per
   row on the device (tir_kernels.sampling; params[r] = (u, temperature, top_k, top_p)), so the
   host reads back token ids, not logits (tvmattn.device_sampling.DeviceSampler calls it)
- `apply_penalties(logits [rows, vocab] f32, token_ids [rows, m] int32, amounts [rows, m] f32)
   -> logits`: subtracts each amount from its row's logit in place (token_ids -1: none), before `sample`
- `_metadata() -> str` (JSON: see `metadata`)
`params` is the list of weights in the order of metadata["params"], each of its shape and dtype
(`pack_params` makes it from HF-named tensors). The host drives the cache with
`tvmattn.kv_state_*` (kv_cache="tvmattn"; tvmattn must be imported in that process) or
`vm.builtin.kv_state_*` (kv_cache="tvm") around each call.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import tvm
from tvm import relax

from tir_kernels import tvm_target
from tir_kernels.build import PIPELINE
from tir_kernels.sampling import SamplingConfig, apply_penalties, feed_tokens, sample_tokens
from tir_kernels.support import FP8_KV_DTYPES, TargetName, dtype_problem, is_fp8, numpy_dtype, page_size_problem

from ..compiler.dependent_launch import dependent_launch_problem
from ..compiler.tensor_core_matmul import (DTYPES as TENSOR_CORE_DTYPES, choose_skinny_schedule, swiglu_matmul_takes,
                                          tensor_core_matmul_problem)
from ..compiler.fused_decode import fused_decode
from ..compiler.pipeline import relax_pipeline
from ..compiler.script_frames import cheap_frame_stacks
# exported by every library beside its architecture's functions (model-independent)
from ..device_sampling import FEED_FUNCTION, SAMPLING_FUNCTIONS
from ..quant.linear import dequantized, packed_part, split_part_name
from .architectures import architecture
from .architectures import cache_spec as architecture_cache_spec
from .config import AnyModelConfig, model_config_from_dict
from .kv_cache import KV_CACHE_KINDS, KVCacheSpec, attention_backend_record

METADATA_FUNCTION = "_metadata"


@dataclasses.dataclass(frozen=True)
class BuildOptions:
    """target: "llvm", "cuda" or "cuda:sm_XX"; dtype: weights and activations; page_size: KV
    page size compiled into tvmattn's kernels; kv_cache: "tvmattn" or "tvm" (TVM's stock cache);
    weight_formats: (parameter prefix, GGUF block type) of each layer kept quantized
    (quant/linear.py; llvm with float32, cuda with float16). dtype, page size and target are checked against
    tir_kernels.support (ValueError). An llvm library with quantized weights is compiled for the
    host's CPU."""

    target: str = "llvm"
    dtype: str = "float32"
    page_size: int = 16
    kv_cache: str = "tvmattn"
    weight_formats: tuple[tuple[str, str], ...] = ()
    kv_dtype: str = ""  # the KV pages' element type: "" (dtype) or an FP8 format
    max_batch_size: int = 4  # the most sequences of one decode_step (its storage is planned for it)
    small_batch_matmul: bool = True  # CUDA: compiler.pipeline.SmallBatchMatmul for decode_step's projections
    # llvm with weight_formats: compile with the host's AVX-512 (compiler.targets.host_target), for
    # libraries whose every matrix is kept quantized (build.py sets it; float matmuls compile slowly)
    host_avx512: bool = False
    # the decoder layers' decode ops fused (compiler.fused_decode: RMSNorm into the next
    # projection, SiLU * mul into gate_up); False: the plain ops (the library before the fusion)
    fused_layers: bool = True
    # llvm with kept blocks on a CPU with AVX512-BF16: the prefill GEMMs multiply in bfloat16
    # (quant.cpu.unpack_gemm: twice float32's rate, within its stated bound); False: float32
    cpu_bf16: bool = True
    # CUDA sm_90+: every kernel launched with programmatic dependent launch
    # (compiler.dependent_launch); None: wherever the target takes it
    dependent_launch: bool | None = None
    # CUDA sm_80+ with small_batch_matmul: decode_step's projections on tensor cores from batch
    # 16 on (compiler.tensor_core_matmul); None: wherever the target takes it
    tensor_core_matmul: bool | None = None
    # CUDA with tensor_core_matmul: the fused decode ops in batch_decode / decode_step too (the
    # fused GEMV below batch 16, compiler.tensor_core_matmul.norm_matmul from 16 on); off: slower
    # than the plain ops at batch 64 (docs/performance.md, "Tried and rejected")
    fused_batch_layers: bool = False
    # tvmattn's cache: the K/V append inside the tensor-core decode kernel (one launch a layer,
    # tir_kernels.paged_decode_append) where the decode takes that kernel; False: split_rotary_append
    # then the decode (two)
    decode_append: bool = True

    def __post_init__(self):
        if not isinstance(self.max_batch_size, int) or self.max_batch_size < 1:
            raise ValueError(f"max_batch_size={self.max_batch_size!r} is not supported: expected an int >= 1")
        if not isinstance(self.host_avx512, bool):
            raise ValueError(f"host_avx512={self.host_avx512!r} is not supported: expected a bool")
        if not isinstance(self.cpu_bf16, bool):
            raise ValueError(f"cpu_bf16={self.cpu_bf16!r} is not supported: expected a bool")
        if not isinstance(self.fused_layers, bool):
            raise ValueError(f"fused_layers={self.fused_layers!r} is not supported: expected a bool")
        if not isinstance(self.decode_append, bool):
            raise ValueError(f"decode_append={self.decode_append!r} is not supported: expected a bool")
        if not isinstance(self.small_batch_matmul, bool):
            raise ValueError(f"small_batch_matmul={self.small_batch_matmul!r} is not supported: expected a bool")
        if self.dependent_launch is not None and not isinstance(self.dependent_launch, bool):
            raise ValueError(f"dependent_launch={self.dependent_launch!r} is not supported: expected a bool or None")
        if self.tensor_core_matmul is not None and not isinstance(self.tensor_core_matmul, bool):
            raise ValueError(f"tensor_core_matmul={self.tensor_core_matmul!r} is not supported: expected a bool or None")
        for name, problem in (("dtype", dtype_problem), ("page_size", page_size_problem)):
            expected = problem(getattr(self, name))
            if expected:
                raise ValueError(f"{name}={getattr(self, name)!r} is not supported: expected {expected}")
        if self.kv_cache not in KV_CACHE_KINDS:
            raise ValueError(f"kv_cache={self.kv_cache!r} is not supported: expected one of {KV_CACHE_KINDS}")
        if self.kv_dtype in (self.dtype,):
            object.__setattr__(self, "kv_dtype", "")
        if self.kv_dtype and (not is_fp8(self.kv_dtype) or self.kv_cache != "tvmattn"):
            raise ValueError(f"kv_dtype={self.kv_dtype!r} is not supported: expected the dtype or one of "
                             f"{FP8_KV_DTYPES} (FP8 pages: tvmattn's cache only)")
        TargetName.parse(self.target)
        if self.dependent_launch is None:
            object.__setattr__(self, "dependent_launch", dependent_launch_problem(self.target) is None)
        if self.dependent_launch and dependent_launch_problem(self.target):
            raise ValueError(f"dependent_launch=True is not supported with target={self.target!r}: "
                             f"{dependent_launch_problem(self.target)}")
        if self.tensor_core_matmul is None:
            object.__setattr__(self, "tensor_core_matmul",
                               tensor_core_matmul_problem(self.target, self.small_batch_matmul) is None)
        if not isinstance(self.fused_batch_layers, bool):
            raise ValueError(f"fused_batch_layers={self.fused_batch_layers!r} is not supported: expected a bool")
        if self.fused_batch_layers and not (self.tensor_core_matmul and self.fused_layers):
            raise ValueError("fused_batch_layers=True is not supported: it needs tensor_core_matmul and fused_layers")
        if self.tensor_core_matmul and tensor_core_matmul_problem(self.target, self.small_batch_matmul):
            raise ValueError(f"tensor_core_matmul=True is not supported: "
                             f"{tensor_core_matmul_problem(self.target, self.small_batch_matmul)}")
        if self.weight_formats:
            from ..weights.quant import QUANT_TYPES

            bad = [fmt for _, fmt in self.weight_formats if fmt not in QUANT_TYPES]
            if bad:
                raise ValueError(f"weight_formats: {bad[0]!r} is not supported: expected one of {QUANT_TYPES}")
            wanted = "float32" if self.target == "llvm" else "float16"
            if self.dtype != wanted:
                raise ValueError(f"weight_formats (quantized weights) need dtype {wanted!r} on {self.target!r} "
                                 f"(the fused kernels' activations), got {self.dtype!r}")

    def cache_spec(self, config: AnyModelConfig) -> KVCacheSpec:
        """KVCacheSpec (Llama family) or MLACacheSpec (DeepSeek) of `config` (architectures.py)."""
        return architecture_cache_spec(config, self)

    def tvm_target(self) -> tvm.target.Target:
        if self.target == "llvm" and self.weight_formats:
            from ..compiler.targets import host_target

            # the host CPU's instructions and vector width for the fused kernels (plain "llvm" is
            # SSE2); float builds keep plain llvm: dlight's schedules compile much slower for the
            # host's CPU (docs/performance.md)
            return host_target(avx512=self.host_avx512, bf16=self.cpu_bf16)
        return tvm_target(self.target, schedule_rules=True)


@dataclasses.dataclass
class ModelLibrary:
    """A compiled library in memory: `executable` (load into relax.VirtualMachine) and its metadata."""

    executable: relax.VMExecutable
    metadata: dict[str, Any]

    @property
    def param_names(self) -> list[str]:
        return [p["name"] for p in self.metadata["params"]]


def metadata(config: AnyModelConfig, options: BuildOptions, params: list[tuple[str, Any]]) -> dict[str, Any]:
    """The JSON document `_metadata` returns."""
    spec = options.cache_spec(config)
    return {
        "model_type": architecture(config).model_type,
        "model_config": config.to_dict(),
        "params": [{"name": name, "shape": [int(d) for d in p.shape], "dtype": str(p.dtype)} for name, p in params],
        "kv_cache": {"kind": options.kv_cache, **spec.to_dict(), "attention_backend": attention_backend_record(spec)},
        "build_options": dataclasses.asdict(options),
        "functions": list(architecture(config).functions) + list(SAMPLING_FUNCTIONS) + [FEED_FUNCTION],
        "param_mode": "packed",
    }


def _attach_metadata(mod: tvm.IRModule, document: dict[str, Any]) -> tvm.IRModule:
    bb = relax.BlockBuilder()
    with bb.function(METADATA_FUNCTION, params=[]):
        bb.emit_func_output(tvm.ir.StringImm(json.dumps(document)))
    mod[METADATA_FUNCTION] = bb.finalize()[METADATA_FUNCTION]
    return mod


def sampling_module(target: str) -> tvm.IRModule:
    """The Relax functions `sample` and `apply_penalties` (module docstring) over float32 logits
    of any shape [rows, vocab], and `feed_tokens(tokens [rows] i32, ids [rows] i32)` (writes ids
    in place and returns them), for `target` (a target string), with their kernels
    (tir_kernels.sampling). Functions of their own rather than fused into the logits' producers:
    every function that makes logits (decode_step, batch_decode, batch_prefill, ...) keeps its
    signature, the logits stay on the device for the rows the host samples (grammar masks,
    logprobs), and the caller passes the logits tensor it got, so only the ids come back."""
    config = SamplingConfig("float32", target)
    rows, vocab, count = (tvm.tirx.Var(name, "int64") for name in ("rows", "vocab", "count"))
    bb = relax.BlockBuilder()
    logits = relax.Var("logits", relax.TensorType((rows, vocab), "float32"))
    params = relax.Var("params", relax.TensorType((rows, 4), "float32"))
    with bb.function("sample", [logits, params]):
        kernel = bb.add_func(sample_tokens(config).with_attr("tirx.is_scheduled", True), "tvmattn_sample")
        bb.emit_func_output(bb.emit(relax.call_tir(kernel, [logits, params], relax.TensorType((rows,), "int32"))))
    logits = relax.Var("logits", relax.TensorType((rows, vocab), "float32"))
    ids = relax.Var("token_ids", relax.TensorType((rows, count), "int32"))
    amounts = relax.Var("amounts", relax.TensorType((rows, count), "float32"))
    with bb.function("apply_penalties", [logits, ids, amounts]):
        kernel = bb.add_func(apply_penalties(config).with_attr("tirx.is_scheduled", True), "tvmattn_apply_penalties")
        bb.emit_func_output(bb.emit(relax.call_tir_inplace(kernel, [logits, ids, amounts], [0],
                                                           relax.TensorType((rows, vocab), "float32"))))
    tokens = relax.Var("tokens", relax.TensorType((rows,), "int32"))
    ids = relax.Var("ids", relax.TensorType((rows,), "int32"))
    with bb.function(FEED_FUNCTION, [tokens, ids]):
        kernel = bb.add_func(feed_tokens(config).with_attr("tirx.is_scheduled", True), "tvmattn_feed_tokens")
        bb.emit_func_output(bb.emit(relax.call_tir_inplace(kernel, [tokens, ids], [1],
                                                           relax.TensorType((rows,), "int32"))))
    return bb.finalize()


def _attach_sampling(mod: tvm.IRModule, options: BuildOptions) -> tvm.IRModule:
    for gv, func in sampling_module(options.target).functions.items():
        mod[gv] = func
    return mod


def fused_on_tensor_cores(config: AnyModelConfig, options: BuildOptions) -> bool:
    """Whether a CUDA library's fused decode ops (compiler.fused_decode) run at every batch: with
    fused_batch_layers (and so tensor_core_matmul) on, a 16-bit dtype, and norm_matmul schedules
    for the model's qkv and gate_up shapes
    (compiler.tensor_core_matmul.FusedNormTensorCoreMatmul takes them from batch 16 on)."""
    if not options.fused_batch_layers or options.dtype not in TENSOR_CORE_DTYPES:
        return False
    try:
        hidden, qkv = config.hidden_size, config.q_size + 2 * config.kv_size
        intermediate = config.intermediate_size
    except AttributeError:  # (an architecture without the fused ops)
        return False
    return all(choose_skinny_schedule(n, hidden, halves, norm=True) is not None
               for n, halves in ((qkv, 1), (intermediate, 2)))


def swiglu_on_tensor_cores(config: AnyModelConfig, options: BuildOptions) -> bool:
    """Whether a CUDA library's batched decode steps write gate_up and SiLU * mul as one
    fused_decode.matmul_swiglu (tensor_core_matmul's "swiglu" kernel, at every batch): with
    tensor_core_matmul and fused_layers on, fused_batch_layers off (its own fused op takes the
    norm too), a 16-bit dtype and a kernel schedule for the model's gate_up."""
    if (options.target == "llvm" or not options.tensor_core_matmul or not options.fused_layers
            or options.fused_batch_layers or options.dtype not in TENSOR_CORE_DTYPES):
        return False
    try:
        hidden, intermediate = config.hidden_size, config.intermediate_size
    except AttributeError:  # (an architecture without an MLP of this shape)
        return False
    return swiglu_matmul_takes(intermediate, hidden, options.dtype)


def export_module(config: AnyModelConfig, options: BuildOptions) -> tuple[tvm.IRModule, dict[str, Any]]:
    """The Relax IRModule of the model library (before compilation) and its metadata."""
    formats = dict(options.weight_formats)
    arch = architecture(config)
    model = arch.model_class(config, options.cache_spec(config), options.kv_cache, formats)
    model.to(options.dtype)
    # quant.linear picks its kernels' target from the target scope
    # on a GPU the fused ops in `decode` (batch 1) only, unless fused_batch_layers: compiler.fused_decode
    single_row_only = options.target != "llvm" and not fused_on_tensor_cores(config, options)
    swiglu = swiglu_on_tensor_cores(config, options)
    with options.tvm_target(), fused_decode(options.fused_layers, single_row_only, batched_swiglu=swiglu), \
            cheap_frame_stacks():  # (the kernel generators parse TVMScript: compiler.script_frames)
        mod, params = model.export_tvm(spec=model.get_default_spec())
    if "decode_step" in arch.functions:  # storage planned for the largest batch (see compiler/pipeline.py)
        step = mod.get_global_var("decode_step")
        mod[step] = mod[step].with_attr("tir_var_upper_bound", {"batch_size": options.max_batch_size})
    document = json.loads(json.dumps(metadata(config, options, params)))  # JSON types, as `_metadata` returns it
    expected = list(arch.parameter_sources(config, formats))
    if [name for name, _ in params] != expected:
        raise AssertionError(f"model parameters {[n for n, _ in params]} differ from the HF map {expected}")
    return _attach_metadata(_attach_sampling(mod, options), document), document


def compile_module(mod: tvm.IRModule, options: BuildOptions) -> relax.VMExecutable:
    """Compile an exported module for options' target with the model pipeline (compiler/pipeline.py)."""
    target = options.tvm_target()
    with target:
        # tir_kernels' pipeline: the Hopper attention kernels are lowered by TVM's TIRx pipeline
        pipeline = relax_pipeline(target, options.small_batch_matmul, dependent_launch=options.dependent_launch,
                                  tensor_core_matmul=options.tensor_core_matmul)
        return tvm.compile(mod, target=target, relax_pipeline=pipeline, tir_pipeline=PIPELINE)


def compile_library(config: AnyModelConfig, options: BuildOptions | None = None, **kwargs) -> ModelLibrary:
    """Export and compile the library in memory (options, or BuildOptions fields as kwargs)."""
    options = options or BuildOptions(**kwargs)
    mod, document = export_module(config, options)
    return ModelLibrary(compile_module(mod, options), document)


def export_library(config: AnyModelConfig, target: str = "llvm", dtype: str = "float32",
                   out_path: str | Path = "model.so", *, page_size: int = 16,
                   kv_cache: str = "tvmattn") -> ModelLibrary:
    """Compile the library and write it to out_path (a shared library for relax.VirtualMachine)."""
    library = compile_library(config, BuildOptions(target=target, dtype=dtype, page_size=page_size,
                                                    kv_cache=kv_cache))
    out_path = Path(out_path)
    tmp = out_path.with_name(out_path.name + ".partial.so")
    library.executable.export_library(str(tmp))
    tmp.replace(out_path)
    return library


def read_metadata(vm: relax.VirtualMachine) -> dict[str, Any]:
    """The parsed `_metadata` of a loaded library."""
    return json.loads(str(vm[METADATA_FUNCTION]()))


def pack_params(document: dict[str, Any], tensors: Mapping[str, np.ndarray]) -> list[np.ndarray]:
    """HF-named tensors (e.g. from tvmattn.weights) -> the library's params list, in order, in the
    library's dtype; fused projections are concatenated. Raises ValueError naming a missing
    tensor or a wrong shape."""
    config = model_config_from_dict(document.get("model_type", "llama"), document["model_config"])
    formats = dict(map(tuple, document["build_options"].get("weight_formats", ())))
    arch = architecture(config)
    sources = arch.parameter_sources(config, formats)
    tensors = arch.prepare_tensors(config, tensors)
    dtype = np.dtype(numpy_dtype(document["build_options"]["dtype"]))
    packed = []
    for param in document["params"]:
        names = sources[param["name"]]
        missing = [n for n in names if n not in tensors]
        if missing:
            raise ValueError(f"weights: tensor {missing[0]!r} (for parameter {param['name']!r}) is missing")
        quantized = split_part_name(param["name"])
        if quantized is not None and quantized[0] in formats:  # a block array: kept in its own dtype
            try:
                value = packed_part([tensors[n] for n in names], formats[quantized[0]], quantized[1])
            except ValueError as err:
                raise ValueError(f"weights: {'+'.join(names)} for parameter {param['name']!r}: {err}") from None
            if list(value.shape) != param["shape"] or str(value.dtype) != param["dtype"]:
                raise ValueError(f"weights: {'+'.join(names)} gives {value.dtype} {list(value.shape)}, "
                                 f"parameter {param['name']!r} needs {param['dtype']} {param['shape']}")
            packed.append(np.ascontiguousarray(value))
            continue
        value = np.concatenate([dequantized(tensors[n]) for n in names], axis=0) if len(names) > 1 \
            else dequantized(tensors[names[0]])
        if list(value.shape) != param["shape"]:
            raise ValueError(f"weights: {'+'.join(names)} has shape {list(value.shape)}, "
                             f"parameter {param['name']!r} needs {param['shape']}")
        packed.append(np.ascontiguousarray(value.astype(dtype)))
    return packed
