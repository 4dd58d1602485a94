"""Choosing the attention backend of a cache: tvmattn's TIR kernels or FlashInfer's modules.

`attention_kernels(backend, options, target, kernels)` gives the backend a cache runs and its
kernel overrides. FlashInfer serves the ragged prefill, paged prefill and paged decode slots of
a cache on a CUDA GPU of sm_80 or newer, in float16/bfloat16, with head dim 64, 128 or 256,
without sliding windows and without inline RoPE; anything else falls back to TIR with a logged
warning that says why. Token-tree steps always run TIR tree-mask kernels (FlashInfer has none;
the cache warns on the first one). Asking for FlashInfer where it could serve but its modules
are not built is an error (KVCacheError naming the build command).

Part of the runtime (it knows the cache's options, errors and backends); `tvmattn.flashinfer`
below it only locates, loads and views FlashInfer's modules, and imports nothing of the runtime.
"""

from __future__ import annotations

import logging

from tvmattn.flashinfer.modules import FlashInferConfig, FlashInferModulesMissing, load

from .backends import FlashInferTensorCoreDecode, RopeMode
from .errors import KVCacheError

log = logging.getLogger("tvmattn.flashinfer")  # the warnings are about FlashInfer: its logger

BACKENDS = ("tir", "flashinfer")
DECODE_KINDS = ("cuda_core", "tensor_core")
PREFILL_KINDS = ("fa2", "fa3")


def config_for(options, target: str) -> FlashInferConfig:
    arch = target.split(":", 1)[1] if target.startswith("cuda:") else ""
    if arch == "sm_90":
        arch = "sm_90a"
    return FlashInferConfig(options.dtype, options.qk_head_dim, options.v_head_dim, False, arch)


def why_not(options, target: str) -> str | None:
    """Why FlashInfer cannot serve a cache of `options` on `target` (None: it can)."""
    if not target.startswith("cuda"):
        return f"the device is not a CUDA GPU (target {target})"
    if ":" not in target:
        return "the GPU's arch is unknown"
    return cache_problem(options) or config_for(options, target).problem()


def cache_problem(options) -> str | None:
    """Why FlashInfer's modules (built without RoPE, no windows) give wrong results in a cache of
    `options` whatever the device (None: they do not)."""
    if getattr(options, "kv_fp8", False):
        return f"kv_dtype={options.kv_dtype!r} (FlashInfer's modules here read fp16/bf16 pages)"
    if options.support_sliding_window:
        return "the cache supports sliding windows (FlashInfer's modules here have no window/sink offsets)"
    if options.effective_rope_mode == RopeMode.INLINE:
        return 'rope_mode is "inline" (FlashInfer\'s inline RoPE ignores the cache\'s RoPE position arrays)'
    return None


def _is_flashinfer(spec) -> bool:
    if getattr(spec, "kind", None) == "flashinfer":
        return True
    try:
        return not callable(spec) and len(spec) > 0 and str(spec[0]) == "flashinfer"
    except TypeError:
        return False


def attention_kernels(backend: str, options, target: str, kernels: dict | None, *, decode: str = "cuda_core",
                      prefill: str = "fa2", base=None) -> tuple[str, dict | None]:
    """(backend the cache runs, kernel overrides): for "flashinfer", FlashInfer specs for the
    attention slots (the caller's own `kernels` win), or a warning and TIR when it cannot serve."""
    if backend not in BACKENDS:
        raise KVCacheError(f"backend must be one of {BACKENDS}, got {backend!r}")
    given = [slot for slot, spec in dict(kernels or {}).items() if _is_flashinfer(spec)]
    problem = cache_problem(options)
    if given and problem:  # FlashInfer specs given by the caller (a model library's, say)
        log.warning("FlashInfer kernels given for %s not used, falling back to tvmattn's TIR kernels: %s",
                    ", ".join(given), problem)
        kernels = {slot: spec for slot, spec in kernels.items() if slot not in given}
    if backend == "tir":
        return ("flashinfer" if given and not problem else "tir"), kernels
    if decode not in DECODE_KINDS or prefill not in PREFILL_KINDS:
        raise KVCacheError(f"FlashInfer decode must be one of {DECODE_KINDS} and prefill one of {PREFILL_KINDS}, "
                           f"got {decode!r}, {prefill!r}")
    reason = why_not(options, target)
    if reason is not None:
        log.warning("FlashInfer backend not used, falling back to tvmattn's TIR kernels: %s", reason)
        return "tir", kernels
    try:
        specs = flashinfer_specs(config_for(options, target), decode=decode, prefill=prefill, base=base)
    except FlashInferModulesMissing as error:
        raise KVCacheError(str(error)) from None
    return "flashinfer", {**specs, **dict(kernels or {})}


def flashinfer_specs(config: FlashInferConfig, *, decode: str = "cuda_core", prefill: str = "fa2",
                     base=None) -> dict:
    """Kernel overrides (slot -> spec) running FlashInfer's built modules of `config`: prefill
    "fa2" or "fa3", decode "cuda_core" (its decode kernel) or "tensor_core" (its FA2 prefill
    kernel with one query per request, whichever the prefill). FlashInferModulesMissing when a module is not built."""
    pre = load(config, f"prefill_{prefill}", base)
    specs = {"prefill_ragged": ["flashinfer", pre.ragged_run, pre.plan],
             "prefill_paged": ["flashinfer", pre.paged_run, pre.plan]}
    if decode == "cuda_core":
        dec = load(config, "decode", base)
        specs["decode_paged"] = ["flashinfer", dec.run, dec.plan]
    else:  # FA2's paged prefill: FA3's reads each request's key count from the plan, which the
        # decode plan step can only bound (it gets no last-page lengths), so FA3 would attend to
        # the unused rows of last pages
        fa2 = pre if prefill == "fa2" else load(config, "prefill_fa2", base)
        specs["decode_paged"] = FlashInferTensorCoreDecode(fa2.paged_run, fa2.plan)
    return specs
