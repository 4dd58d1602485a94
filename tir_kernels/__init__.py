"""TIR attention kernels: generators from a validated config to a TIR PrimFunc.

Each generator takes an `AttentionConfig` (and optionally a schedule) and returns a PrimFunc
whose parameters follow the attention-backend contract (docs/interface.md).

The names below are imported on first use (PEP 562), so that `tir_kernels.support` (what the
kernels support; no TVM import) is cheap to read for the command line.
"""

import importlib

_EXPORTS = {
    "build": "build",
    "EMPTY_LSE": "common",
    "AttentionConfig": "config",
    "RopeScaling": "config",
    "default_sm_scale": "config",
    "tvm_target": "config",
    "paged_decode": "decode",
    "paged_decode_tc": "decode_tc",
    "merge_state": "merge",
    "MLAConfig": "config",
    "MLASchedule": "mla",
    "choose_mla_schedule": "mla",
    "mla_copy_single_page": "mla",
    "mla_debug_get_kv": "mla",
    "mla_paged_decode": "mla",
    "mla_paged_prefill": "mla",
    "mla_transpose_append": "mla",
    "compact_copy": "page_ops",
    "copy_single_page": "page_ops",
    "debug_get_kv": "page_ops",
    "transpose_append": "page_ops",
    "split_rotary": "rotary",
    "split_rotary_append": "rotary",
    "paged_prefill": "prefill",
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
