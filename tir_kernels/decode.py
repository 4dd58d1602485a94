"""Paged decode attention (one query token per request), MHA/GQA: the choice of kernel.

Two kernels compute the contract's decode (`paged_decode`'s docstring), below this module:
decode_simt.py on CUDA cores (and the CPU) and decode_tc.py on tensor cores (fp16/bf16 GQA
groups on CUDA sm_80 and newer). `choose_decode_kernel` says which one serves a config, with
which schedules, and why the tensor-core kernel was passed over where it was.
`paged_decode_append` (tvmattn's own) is split_rotary_append and the tensor-core decode in one
launch, where paged_decode would take the tensor-core kernel.
"""

from __future__ import annotations

from typing import NamedTuple

from .config import AttentionConfig
from .decode_simt import paged_decode_simt
from .decode_tc import paged_decode_append_tc, paged_decode_tc
from .schedules import (DecodeSchedule, TensorCoreDecodeSchedule, choose_decode_schedule, choose_decode_variant,
                        tc_decode_problem)

# Whether paged_decode(config) serves fp16/bf16 GQA groups of 3..16 on CUDA sm_80+ with the
# tensor-core kernel (decode_tc.py; `schedules.tc_decode_applies`); tests/test_decode_tc.py runs
# it on the GPU.
TENSOR_CORE_DECODE = True


class DecodeChoice(NamedTuple):
    """`choose_decode_kernel`'s answer: kernel "decode_tc" (tensor cores) or "decode" (CUDA
    cores / CPU), its schedule and, for the tensor-core kernel, the inline-RoPE build's schedule
    (None: decode_tc's default); reason: why the tensor-core kernel does not serve the config
    (None where it does, or where the caller's schedule named the kernel)."""

    kernel: str
    schedule: DecodeSchedule | TensorCoreDecodeSchedule
    rope_schedule: TensorCoreDecodeSchedule | None
    reason: str | None


def choose_decode_kernel(config: AttentionConfig,
                         schedule: DecodeSchedule | TensorCoreDecodeSchedule | None = None,
                         rope_schedule: TensorCoreDecodeSchedule | None = None) -> DecodeChoice:
    """The kernel and schedules `paged_decode(config, schedule, rope_schedule)` builds.

    A schedule names its kernel (a TensorCoreDecodeSchedule the tensor-core one, with
    rope_schedule; a DecodeSchedule the CUDA-core one). Without one, the CPU takes the CUDA-core
    kernel's default schedule; a CUDA config the decode table's choice for its bucket, else the
    defaults (`schedules.choose_decode_variant`: the tensor-core kernel where
    `schedules.tc_decode_problem` finds no problem), and the CUDA-core default schedule where the
    table names a tensor-core schedule but TENSOR_CORE_DECODE is off.
    """
    if schedule is not None:
        if isinstance(schedule, TensorCoreDecodeSchedule):
            return DecodeChoice("decode_tc", schedule, rope_schedule, None)
        return DecodeChoice("decode", schedule, None, None)
    problem = tc_decode_problem(config)
    if not config.is_gpu:
        return DecodeChoice("decode", choose_decode_schedule(config), None, problem)
    schedule, table_rope = choose_decode_variant(config, rope=True)
    if isinstance(schedule, TensorCoreDecodeSchedule):
        if TENSOR_CORE_DECODE and problem is None:
            return DecodeChoice("decode_tc", schedule, rope_schedule or table_rope, None)
        return DecodeChoice("decode", choose_decode_schedule(config), None,
                            problem or "the tensor-core decode is off (decode.TENSOR_CORE_DECODE)")
    return DecodeChoice("decode", schedule, None, problem or "the decode table chose the CUDA-core kernel")


def paged_decode(config: AttentionConfig, schedule: DecodeSchedule | TensorCoreDecodeSchedule | None = None,
                 rope_schedule: TensorCoreDecodeSchedule | None = None):
    """Paged decode PrimFunc, arguments in the contract's order:

    q [B, Hq, D], pages [P, 2, Hkv, page_size, D], page_indptr [B+1] i32,
    page_indices [nnz] i32, length_info [B] (or [3, B] sliding) i32, k_rope_pos_offset [B] i32,
    q_rope_position [B] i32, o [B, Hq, D], lse [B, Hq] f32 (base 2), rotary_mode i32,
    rope_scale f32, rope_theta f32, sm_scale f32.
    A request with no visible token gets o = 0 and lse = EMPTY_LSE.

    The kernel and its schedules are `choose_decode_kernel(config, schedule, rope_schedule)`'s:
    without a schedule, a CUDA config takes the decode table's choice for its bucket, else the
    defaults (fp16/bf16 configs with GQA groups of 3..16 on sm_80 and newer get the tensor-core
    kernel, decode_tc.paged_decode_tc); a TensorCoreDecodeSchedule runs the tensor-core kernel;
    a DecodeSchedule, and every other config, the CUDA-core kernel (decode_simt.py).
    rope_schedule (tensor-core kernel only): the schedule of its inline-RoPE build
    (decode_tc.paged_decode_tc; None: the table entry's, or the default for the schedule).
    """
    choice = choose_decode_kernel(config, schedule, rope_schedule)
    if choice.kernel == "decode_tc":
        return paged_decode_tc(config, choice.schedule, choice.rope_schedule)
    return paged_decode_simt(config, choice.schedule)


def decode_append_problem(config: AttentionConfig,
                          schedule: DecodeSchedule | TensorCoreDecodeSchedule | None = None) -> str | None:
    """Why `paged_decode_append(config, schedule)` is not built (None: it is): it exists where
    paged_decode takes the tensor-core kernel, for plain builds (no sliding window, pages of
    the dtype)."""
    if config.sliding_window or config.kv_fp8:
        return (f"sliding_window={config.sliding_window}, kv_dtype={config.kv_dtype!r} (the decode with the append "
                "serves plain builds: no sliding window, pages of the dtype)")
    choice = choose_decode_kernel(config, schedule)
    if choice.kernel != "decode_tc":
        return f"paged_decode takes the CUDA-core kernel ({choice.reason or 'the schedule names it'})"
    return None


def paged_decode_append(config: AttentionConfig, schedule: TensorCoreDecodeSchedule | None = None):
    """split_rotary_append and paged decode in one launch (tvmattn's own kernel), arguments:

    qkv [B, Hq + 2 Hkv, D] (the step's fused projection, RoPE not applied),
    pages [P, 2, Hkv, page_size, D], page_indptr [B+1] i32, page_indices [nnz] i32,
    length_info [B] i32 (the new token counted: it is each request's last visible key),
    q_rope_position [B] i32, append_position [B] i32 (the new token's page slot; negative: not
    stored), o [B, Hq, D], lse [B, Hq] f32 (base 2), apply_rope i64 (> 0: q and the new key
    rotated with the config's theta, scale and scaling), sm_scale f32.
    The tensor-core kernel with paged_decode's schedule for the config (or `schedule`)
    (decode_tc.paged_decode_append_tc); ValueError where `decode_append_problem` names one.
    """
    problem = decode_append_problem(config, schedule)
    if problem is not None:
        raise ValueError(f"paged_decode_append: {problem}")
    return paged_decode_append_tc(config, choose_decode_kernel(config, schedule).schedule)
