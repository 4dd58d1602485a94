"""Compile a model into a library bundle: OUT.so with OUT.params.npz and OUT.runtime.json beside it.

`compile_model` resolves a model (the name `smollm2-135m`, a GGUF file, or a Hugging Face
`config.json`, whose folder may hold safetensors weights), compiles the Llama-family library
(tvmattn.models) for a target and writes the bundle with `tvmattn.bundle.write_bundle` (the
format, and how a failed or interrupted build leaves no half-written output, are described
there). Arguments, the output path and the CUDA arch are checked before the model is loaded, so
a bad one fails at once rather than after the compile. `python -m tvmattn compile` is the
command line over it.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from tir_kernels import support

from .bundle import (COMPILE_COMMAND, PARAMS_SUFFIX, RUNTIME_SUFFIX, folder_problem, output_problem,  # noqa: F401
                     sidecar, write_bundle)

MODEL_NAMES = ("smollm2-135m",)
# --quantization: "keep" a GGUF's Q4_0 / Q4_1 / Q8_0 / Q4_K / Q6_K matrices in their blocks (fused
# dequantize + matmul kernels; activations float32 on llvm, float16 on cuda), or dequantize every
# weight to "f16" / "f32" (the library dtype); "auto" (the command line's default): keep for a
# GGUF input unless --dtype asks for another dtype than the kept library's, else dequantize;
# None: dequantize to the library dtype (float32 on llvm, float16 on cuda)
QUANTIZATIONS = ("auto", "keep", "f16", "f32")
QUANTIZATION_DTYPES = {"f16": "float16", "f32": "float32", "keep": "float32"}


class BuildError(ValueError):
    """A bad argument or an unsupported model: the message says which and why."""


@dataclasses.dataclass(frozen=True)
class BuildResult:
    library: Path
    params: Path | None
    runtime: Path
    target: str
    dtype: str
    timings: dict[str, float]


def resolve_target(target: str, cuda_arch: str | None = None) -> str:
    """The concrete target ("llvm" or "cuda:sm_XY") of a --target value ("auto", "llvm", "cuda"
    or "cuda:sm_XY") and an optional --cuda-arch: see tir_kernels.support.resolve_target (the
    arch of a CUDA target is the one named, else the present GPU's, else sm_90). Resolving an
    already resolved target returns it unchanged. A CUDA arch this machine cannot build for
    (offline_cuda.cuda_arch_problem) is refused here, before any compiling. Raises BuildError."""
    from .offline_cuda import cuda_arch_problem

    try:
        resolved = support.resolve_target(target, cuda_arch)
    except ValueError as err:
        raise BuildError(f"--target {target!r}" + (f" --cuda-arch {cuda_arch!r}" if cuda_arch else "")
                         + f": {err}") from None
    if resolved.startswith("cuda:"):
        arch = resolved.split(":", 1)[1]
        problem = cuda_arch_problem(arch)
        if problem:
            named = f"--cuda-arch {cuda_arch}" if cuda_arch == arch else f"--target {target}"
            raise BuildError(f"{named}: {problem}")
    return resolved


def resolve_quantization(model: str, quantization: str | None, target: str, dtype: str | None) -> str | None:
    """The --quantization a build uses ("keep", "f16", "f32" or None: the library dtype) for a
    requested one (QUANTIZATIONS or None) and a resolved target: "auto" keeps a GGUF input's
    blocks unless `dtype` names another dtype than the kept library's (float32 on llvm, float16
    on cuda), and dequantizes any other input. Raises BuildError."""
    if quantization is None:
        return None
    if quantization not in QUANTIZATIONS:
        raise BuildError(f"--quantization {quantization!r} is not supported: expected one of {QUANTIZATIONS}")
    if quantization != "auto":
        return quantization
    if model not in MODEL_NAMES and Path(model).suffix != ".gguf":
        return None
    return "keep" if dtype in (None, kept_dtype(target)) else None


def kept_dtype(target: str) -> str:
    """The activation dtype of a library that keeps quantized weights (CUDA's fused kernels take float16)."""
    return QUANTIZATION_DTYPES["keep"] if target == "llvm" else "float16"


def _gguf_runtime(path: Path, hf_config: dict[str, Any]) -> dict[str, Any]:
    """Tokenizer JSON, chat template and stop ids from a GGUF file (the architecture's own
    template and stop tokens where the file has no template: models.architectures.default_chat)."""
    from .models.architectures import default_chat
    from .weights import chat_template, tokenizer_from_gguf
    from .weights.gguf_file import open_gguf

    tokenizer = tokenizer_from_gguf(path)
    _, reader = open_gguf(path)
    template, stop_texts = chat_template(path), ()
    if template is None:
        template, stop_texts = default_chat(hf_config)
    stop = []
    field = reader.get_field("tokenizer.ggml.eos_token_id")
    if field is not None:
        stop.append(int(field.contents()))
    for token in ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", *stop_texts):
        token_id = tokenizer.token_to_id(token)
        if token_id is not None and token_id not in stop:
            stop.append(token_id)
    return {"tokenizer": tokenizer.to_str(), "chat_template": template, "stop_token_ids": stop}


def load_model(model: str, keep_quantized: bool = False
               ) -> tuple[dict[str, Any], dict[str, np.ndarray] | None, dict[str, Any]]:
    """(HF config, HF-named float32 tensors or None, run-time tokenizer info) of a --model value
    (keep_quantized: a GGUF's block-quantized matrices as QuantizedTensors)."""
    from .weights import read_gguf, read_safetensors_folder, smollm2_path

    if model in MODEL_NAMES:
        path = smollm2_path()
    else:
        path = Path(model)
        if not path.exists():
            raise BuildError(f"--model {model!r}: no such file; expected one of {MODEL_NAMES}, "
                             f"a .gguf file or a config.json")
    if path.suffix == ".gguf":
        from .models.architectures import gguf_layouts

        loaded = read_gguf(path, keep_quantized=keep_quantized, layouts=gguf_layouts())
        return loaded.hf_config, loaded.tensors, _gguf_runtime(path, loaded.hf_config)
    if path.is_dir():
        path = path / "config.json"
    if path.name.endswith(".json") and path.is_file():
        try:
            hf_config = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise BuildError(f"--model {str(path)!r}: not valid JSON: {err}") from None
        if not isinstance(hf_config, dict):
            raise BuildError(f"--model {str(path)!r}: expected a JSON object")
        tensors = None
        if list(path.parent.glob("*.safetensors")):
            loaded = read_safetensors_folder(path.parent)
            hf_config, tensors = loaded.hf_config, loaded.tensors
        runtime: dict[str, Any] = {"tokenizer": None, "chat_template": None, "stop_token_ids": []}
        tokenizer_file = path.parent / "tokenizer.json"
        if tokenizer_file.is_file():
            runtime["tokenizer"] = tokenizer_file.read_text()
        return hf_config, tensors, runtime
    raise BuildError(f"--model {model!r}: expected one of {MODEL_NAMES}, a .gguf file or a config.json")


def _prepare_dump_folder(folder: Path) -> None:
    """Create the --dump-ir folder (before the build) and check that files can be written there."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise BuildError(f"--dump-ir {str(folder)!r}: cannot create the folder ({err.strerror or err})") from None
    problem = folder_problem(folder)
    if problem:
        raise BuildError(f"--dump-ir {str(folder)!r}: {problem}")


def _dump(path: Path, text: Callable[[], str]) -> None:
    """Write one --dump-ir file; BuildError when it cannot be written."""
    try:
        path.write_text(text())
    except OSError as err:
        raise BuildError(f"--dump-ir: cannot write {path} ({err.strerror or err})") from None


def _positive(name: str, value: int | None) -> None:
    if value is not None and (not isinstance(value, int) or value <= 0):
        raise BuildError(f"{name} must be a positive integer, got {value!r}")


def _attention_backend(attn_backend: str, spec, log: Callable[[str], None]) -> str:
    """The attention backend a library of `spec` gets: "flashinfer" only where it can serve the
    target (else a warning and "tir"); BuildError when its modules are not built."""
    if attn_backend != "flashinfer":
        return attn_backend
    from .flashinfer.modules import FlashInferModulesMissing
    from .models.kv_cache import _flashinfer_specs, flashinfer_problem

    problem = flashinfer_problem(spec)
    if problem:
        log(f"[compile] warning: FlashInfer cannot serve this library ({problem}); using tvmattn's TIR kernels")
        return "tir"
    try:
        _flashinfer_specs(spec)
    except FlashInferModulesMissing as err:
        raise BuildError(str(err)) from None
    return "flashinfer"


def _weight_formats(config, tensors: dict | None, log: Callable[[str], None]) -> tuple[tuple[str, str], ...]:
    """(parameter prefix, block type) of every layer whose weights stay quantized (--quantization keep)."""
    from .models.architectures import architecture
    from .quant.linear import plan_weight_formats

    formats = plan_weight_formats(architecture(config).parameter_sources(config), tensors or {})
    matrices = _weight_matrices(config)
    kinds = sorted(set(formats.values()))
    log(f"[compile] quantization keep: {len(formats)} of {len(matrices)} weight matrices stay quantized "
        f"({', '.join(kinds) or 'none'}); the others are dequantized to the library's dtype")
    return tuple(sorted(formats.items()))


def _weight_matrices(config) -> list[str]:
    """The model's weight matrices (parameter names; the norms' vectors left out)."""
    from .models.architectures import architecture

    return [name for name in architecture(config).parameter_sources(config)
            if name.endswith(".weight") and "norm" not in name]


def _every_matrix_kept(config, weight_formats: tuple[tuple[str, str], ...]) -> bool:
    """Whether every weight matrix stays quantized (no float matmul: the library may be compiled
    with AVX-512, export.BuildOptions.host_avx512)."""
    return len(weight_formats) == len(_weight_matrices(config))


def _check_random_format(random_format: str | None, random_weights: int | None) -> None:
    """BuildError unless random_format is None or a block type random weights can be drawn in."""
    if random_format is None:
        return
    from .weights.random_blocks import RANDOM_BLOCK_TYPES

    if random_format not in RANDOM_BLOCK_TYPES:
        raise BuildError(f"--random-format {random_format!r} is not supported: expected one of "
                         f"{sorted(RANDOM_BLOCK_TYPES)}")
    if random_weights is None:
        raise BuildError(f"--random-format {random_format} needs --random-weights SEED")


def random_params(document: dict[str, Any], seed: int) -> list[np.ndarray]:
    """Random parameters for a library's metadata["params"], in its dtype: vectors (norms) near
    1, the token embedding N(0, 1), other matrices N(0, 1 / in_features) (activations stay O(1))."""
    rng = np.random.default_rng(seed)
    dtype = support.numpy_dtype(document["build_options"]["dtype"])
    params = []
    for param in document["params"]:
        shape = param["shape"]
        if len(shape) == 1:
            value = 1.0 + 0.1 * rng.standard_normal(shape)
        else:
            scale = 1.0 if "embed_tokens" in param["name"] else shape[-1] ** -0.5
            value = scale * rng.standard_normal(shape)
        params.append(value.astype(dtype))
    return params


def compile_model(model: str, out_path: str | Path, *, target: str = "auto", cuda_arch: str | None = None,
                  dtype: str | None = None, page_size: int = 16, max_batch_size: int = 4,
                  context_window: int | None = None, prefill_chunk: int | None = None,
                  kv_cache: str = "tvmattn", dump_ir: str | Path | None = None,
                  log: Callable[[str], None] = print, attn_backend: str = "tir",
                  quantization: str | None = None, random_weights: int | None = None,
                  random_format: str | None = None, small_batch_matmul: bool = True,
                  kv_cache_dtype: str | None = None, fused_layers: bool = True,
                  cpu_bf16: bool = True, dependent_launch: bool | None = None,
                  tensor_core_matmul: bool | None = None, decode_append: bool = True,
                  fused_batch_layers: bool = False) -> BuildResult:
    """Compile `model` into out_path (a .so) with its weights and run-time files beside it.

    dtype defaults to float32 on llvm and float16 on cuda; context_window defaults to the
    model's max_position_embeddings capped at 4096; prefill_chunk to min(context_window, 2048).
    attn_backend: "tir" or "flashinfer" (tvmattn's cache runs FlashInfer's modules built by
    `python -m tvmattn.flashinfer.build`, which ship beside the library; see models/kv_cache.py;
    falls back to "tir" with a warning where FlashInfer cannot serve the target).
    quantization: see QUANTIZATIONS ("keep": float32 on llvm, float16 on cuda; "f16" / "f32" set the
    dtype; "auto", the command line's default, keeps a GGUF's blocks; None dequantizes to the dtype).
    small_batch_matmul: CUDA, schedule decode_step's projections with pipeline.SmallBatchMatmul
    (False: dlight's Matmul rule). fused_layers: the decode ops fused (compiler.fused_decode;
    False: the plain ops). cpu_bf16: llvm with kept blocks, the prefill GEMMs multiply in bfloat16
    where the CPU has AVX512-BF16 (export.BuildOptions.cpu_bf16; False: float32 products).
    dependent_launch: CUDA sm_90 and newer, every kernel launched with programmatic dependent
    launch (compiler.dependent_launch); None: wherever the target takes it, True: an error where
    it does not. tensor_core_matmul: CUDA sm_80 and newer, decode_step's
    projections on tensor cores from batch 16 on (compiler.tensor_core_matmul; needs
    small_batch_matmul); None: wherever the target takes it, True: an error where it does not.
    decode_append: tvmattn's cache appends K/V inside the tensor-core decode kernel where the
    decode takes it (export.BuildOptions.decode_append; False: a separate append kernel).
    fused_batch_layers: CUDA, the fused decode ops in the batched decode steps too
    (export.BuildOptions.fused_batch_layers; needs tensor_core_matmul and fused_layers).
    kv_cache_dtype: the KV pages' element type: None (the dtype) or "float8_e4m3fn" /
    "float8_e5m2" (FP8 pages, half fp16's bytes; scales 1.0 unless the generator sets them,
    `tvmattn.calibrate_kv_scales`).
    random_weights: a seed; a model without weights (a config.json alone) then gets random
    parameters (`random_params`), so that the bundle runs (tests, smoke runs).
    random_format: with random_weights, the random parameters are blocks of this GGUF type
    (weights.random_blocks.RANDOM_BLOCK_TYPES: "Q4_0", "Q4_1", "Q8_0"), kept with quantization
    "keep" and dequantized otherwise, so that libraries of one seed and format (say a kept one
    and a float16 one) hold the same weights.
    Raises BuildError (a ValueError) for bad arguments or an unsupported model; arguments, the
    output path and the --dump-ir folder are checked before anything is loaded.
    """
    from .models import BuildOptions, ModelConfigError, compile_module, export_module, pack_params
    from .models.config import ModelConfig, model_config_from_hf
    from .models.kv_cache import ATTN_BACKENDS, KV_CACHE_KINDS, attention_backend

    for name, value in (("--max-batch-size", max_batch_size), ("--context-window", context_window),
                        ("--prefill-chunk", prefill_chunk)):
        _positive(name, value)
    if support.page_size_problem(page_size):
        raise BuildError(f"--page-size must be {support.page_size_problem(page_size)}, got {page_size!r}")
    if kv_cache not in KV_CACHE_KINDS:
        raise BuildError(f"--kv-cache {kv_cache!r} is not supported: expected one of {KV_CACHE_KINDS}")
    if attn_backend not in ATTN_BACKENDS:
        raise BuildError(f"--attn-backend {attn_backend!r} is not supported: expected one of {ATTN_BACKENDS}")
    if attn_backend == "flashinfer" and kv_cache != "tvmattn":
        raise BuildError("--attn-backend flashinfer needs --kv-cache tvmattn (TVM's stock cache here runs TIR only)")
    if kv_cache_dtype is not None and not (support.is_fp8(kv_cache_dtype) or kv_cache_dtype in support.DTYPES):
        raise BuildError(f"--kv-cache-dtype {kv_cache_dtype!r} is not supported: expected the dtype or one of "
                         f"{support.FP8_KV_DTYPES}")
    if kv_cache_dtype is not None and support.is_fp8(kv_cache_dtype) and kv_cache != "tvmattn":
        raise BuildError(f"--kv-cache-dtype {kv_cache_dtype} needs --kv-cache tvmattn (TVM's stock cache has no FP8)")
    if dtype is not None and support.dtype_problem(dtype):
        raise BuildError(f"--dtype {dtype!r} is not supported: expected {support.dtype_problem(dtype)}")
    _check_random_format(random_format, random_weights)
    if dependent_launch is not None and not isinstance(dependent_launch, bool):
        raise BuildError(f"--dependent-launch must be a bool or None, got {dependent_launch!r}")
    if tensor_core_matmul is not None and not isinstance(tensor_core_matmul, bool):
        raise BuildError(f"--tensor-core-matmul must be a bool or None, got {tensor_core_matmul!r}")
    out_path = Path(out_path)
    problem = output_problem(out_path)
    if problem:
        raise BuildError(f"-o {str(out_path)!r}: {problem}")
    target = resolve_target(target, cuda_arch)
    if dependent_launch:
        from .compiler.dependent_launch import dependent_launch_problem

        if dependent_launch_problem(target):
            raise BuildError(f"--dependent-launch: {dependent_launch_problem(target)}")
    if tensor_core_matmul:
        from .compiler.tensor_core_matmul import tensor_core_matmul_problem

        if tensor_core_matmul_problem(target, small_batch_matmul):
            raise BuildError(f"--tensor-core-matmul: {tensor_core_matmul_problem(target, small_batch_matmul)}")
    quantization = resolve_quantization(model, quantization, target, dtype)
    if quantization is not None:
        wanted = kept_dtype(target) if quantization == "keep" else QUANTIZATION_DTYPES[quantization]
        if dtype is not None and dtype != wanted:
            raise BuildError(f"--quantization {quantization} needs --dtype {wanted} (weights and activations), "
                             f"got --dtype {dtype}")
        dtype = wanted
    dtype = dtype or ("float32" if target == "llvm" else "float16")
    if dump_ir is not None:
        _prepare_dump_folder(Path(dump_ir))
    timings: dict[str, float] = {}

    def stage(name: str, start: float) -> None:
        timings[name] = time.perf_counter() - start
        log(f"[compile] {name}: {timings[name]:.2f} s")

    start = time.perf_counter()
    log(f"[compile] loading model {model!r}")
    hf_config, tensors, runtime = load_model(model, keep_quantized=quantization == "keep")
    try:
        config = model_config_from_hf(hf_config)
    except ModelConfigError as err:
        raise BuildError(f"--model {model!r}: unsupported model: {err}") from None
    from .models.gemma3 import Gemma3Config

    if random_format is not None and random_weights is not None and not isinstance(config, ModelConfig):
        raise BuildError(f"--random-format: random blocks are drawn for the Llama family only, not "
                         f"{hf_config.get('model_type')!r}")
    if quantization == "keep" and not isinstance(config, (ModelConfig, Gemma3Config)):
        raise BuildError(f"--quantization keep: the fused quantized kernels serve the Llama family and Gemma 3 "
                         f"only, not {hf_config.get('model_type')!r}")
    if tensors is None and random_weights is not None and random_format is not None:
        from .weights.random_blocks import random_block_tensors

        log(f"[compile] no weights found beside the config: random {random_format} blocks (seed {random_weights})")
        try:
            tensors = random_block_tensors(hf_config, random_format, random_weights)
        except (KeyError, ValueError) as err:
            raise BuildError(f"--model {model!r}: random {random_format} weights: {err}") from None
    stage("load model", start)
    max_positions = hf_config.get("max_position_embeddings") or 4096
    context_window = context_window or min(int(max_positions), 4096)
    prefill_chunk = prefill_chunk or min(context_window, 2048)

    start = time.perf_counter()
    weight_formats = _weight_formats(config, tensors, log) if quantization == "keep" else ()
    options = BuildOptions(target=target, dtype=dtype, page_size=page_size, kv_cache=kv_cache,
                           weight_formats=weight_formats, max_batch_size=max_batch_size,
                           small_batch_matmul=small_batch_matmul, fused_layers=fused_layers, cpu_bf16=cpu_bf16,
                           dependent_launch=dependent_launch, tensor_core_matmul=tensor_core_matmul,
                           decode_append=decode_append, fused_batch_layers=fused_batch_layers,
                           kv_dtype="" if kv_cache_dtype in (None, dtype) else kv_cache_dtype,
                           host_avx512=bool(weight_formats) and _every_matrix_kept(config, weight_formats))
    attn_backend = _attention_backend(attn_backend, options.cache_spec(config), log)
    log(f"[compile] exporting the Relax module (target {target}, dtype {dtype}, kv cache {kv_cache}, "
        f"attention {attn_backend})")
    with attention_backend(attn_backend):
        mod, document = export_module(config, options)
    if dump_ir is not None:
        _dump(Path(dump_ir) / "model.relax.py", lambda: mod.script(show_meta=False))
    stage("export", start)

    start = time.perf_counter()
    params = None
    if tensors is not None:
        log("[compile] packing weights")
        try:
            params = pack_params(document, tensors)
        except ValueError as err:
            raise BuildError(f"--model {model!r}: {err}") from None
        stage("pack weights", start)
    elif random_weights is not None:
        log(f"[compile] no weights found beside the config: random parameters (seed {random_weights})")
        params = random_params(document, random_weights)
    else:
        log("[compile] no weights found beside the config: writing the library only")

    start = time.perf_counter()
    log(f"[compile] compiling for {target}: legalization, fusion, schedules and lowering (the slow part)")
    # TVM logs "Fast mode segfaults when there are out-of-bounds indices" twice here (C++
    # LOG(WARNING), no filter reaches it): the take of the token-embedding lookup and the take
    # of batch_prefill's logit positions are legalized in "fast" mode, which does not check its
    # indices. It does not apply to these libraries: Generator checks every prompt token id
    # against the vocabulary, sampled ids come from the vocabulary, and it computes the logit
    # positions itself. Say so in the log, so that the warning does not alarm.
    log("[compile] note: TVM's warning 'Fast mode segfaults when there are out-of-bounds indices' concerns "
        "the token-embedding and logit-position lookups; tvmattn.generate checks token ids against the "
        "vocabulary and computes the positions itself, so it does not apply")
    executable = compile_module(mod, options)
    if dump_ir is not None:
        _dump(Path(dump_ir) / "library.txt", executable.as_text)
    stage("compile", start)
    gpu_code = None
    if target.startswith("cuda"):
        from .offline_cuda import gpu_code_form

        gpu_code = gpu_code_form()
        if gpu_code == "cubin":
            log(f"[compile] GPU code: cubin for {target.split(':')[1]}")
        else:
            log("[compile] GPU code: CUDA source, compiled when the library loads (this process has no CUDA "
                f"runtime; {COMPILE_COMMAND} restarts with a stand-in driver to embed cubins)")

    start = time.perf_counter()
    settings = {"max_batch_size": max_batch_size, "context_window": context_window,
                "prefill_chunk": prefill_chunk, "page_size": page_size, "gpu_code": gpu_code}
    try:
        library, params_file, runtime_file = write_bundle(out_path, executable, params, document, settings, model,
                                                          runtime, target, log)
    except OSError as err:  # e.g. the disk filled up: the earlier bundle, if any, is as it was
        raise BuildError(f"-o {str(out_path)!r}: writing the bundle failed ({err})") from None
    stage("write", start)
    log(f"[compile] wrote {library}" + (f", {params_file}" if params_file is not None else "") + f", {runtime_file}")
    return BuildResult(library, params_file, runtime_file, target, dtype, timings)
