"""TIR attention kernels: generators from a validated config to a TIR PrimFunc.

Each generator takes an `AttentionConfig` (and optionally a schedule) and returns a PrimFunc
whose parameters follow the attention-backend contract (docs/interface.md).

The names below are imported on first use (PEP 562), so that `tir_kernels.support` (what the
kernels support; no TVM import) is cheap to read for the command line.

Layering: each kernel family has one dispatch module (decode.py, prefill.py, mla.py) above its
kernels (decode_simt / decode_tc, prefill_simt / prefill_sm80 / prefill_sm90, mla_simt / mla_tc
/ mla_sm90), which build on shared modules below them (the *_contract modules, mma, hopper,
simt_tile, softmax, masks, schedules, common, config, support); no module imports one above it.
"""

import importlib
import sys
import types

_EXPORTS = {
    "build": "build",
    "EMPTY_LSE": "common",
    "AttentionConfig": "config",
    "RopeScaling": "config",
    "default_sm_scale": "config",
    "tvm_target": "config",
    "paged_decode": "decode",
    "choose_decode_kernel": "decode",
    "paged_decode_tc": "decode_tc",
    "paged_decode_append": "decode",
    "decode_append_problem": "decode",
    "merge_state": "merge",
    "MLAConfig": "config",
    "MLASchedule": "mla_simt",
    "choose_mla_schedule": "mla_simt",
    "mla_copy_single_page": "mla_page_ops",
    "mla_debug_get_kv": "mla_page_ops",
    "mla_paged_decode": "mla_simt",
    "mla_paged_prefill": "mla",
    "mla_paged_decode_auto": "mla",
    "choose_mla_decode_kernel": "mla",
    "choose_mla_prefill_kernel": "mla",
    "mla_transpose_append": "mla_page_ops",
    "compact_copy": "page_ops",
    "copy_single_page": "page_ops",
    "debug_get_kv": "page_ops",
    "transpose_append": "page_ops",
    "split_rotary": "rotary",
    "split_rotary_append": "rotary",
    "paged_prefill": "prefill",
    "choose_prefill_kernel": "prefill",
    "ragged_prefill": "prefill",
    "tree_mask_paged_prefill": "prefill",
    "tree_mask_ragged_prefill": "prefill",
    "CopySchedule": "schedules",
    "DecodeSchedule": "schedules",
    "PrefillSchedule": "schedules",
    "TensorCoreDecodeSchedule": "schedules",
    "choose_copy_schedule": "schedules",
    "choose_decode_schedule": "schedules",
    "choose_prefill_schedule": "schedules",
    "choose_tc_decode_schedule": "schedules",
    "SamplingConfig": "sampling",
    "SamplingSchedule": "sampling",
    "apply_penalties": "sampling",
    "choose_sampling_schedule": "sampling",
    "sample_tokens": "sampling",
    "CAPABILITIES": "support",
    "KernelChoice": "support",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'tir_kernels' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))


class _Package(types.ModuleType):
    """The package's module type: loading a submodule binds it on its package under its name, which
    would hide an exported function of the same name (`build` is both): keep the function."""

    def __setattr__(self, name, value):
        if isinstance(value, types.ModuleType) and _EXPORTS.get(name) == name:
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
