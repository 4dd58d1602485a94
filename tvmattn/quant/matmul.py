"""Fused dequantize + matmul (and embedding lookup) over GGUF block-quantized weights: the
scheduled kernel of a `QuantMatmulConfig` on its target (`kernel`).

What a config computes: config.py (the block formats and their arrays) and algorithms.py (the TE
algorithms). Which kernel computes it:
- llvm: the schedules of cpu.py over algorithms.py's algorithms (the one-token product in
  block-factored form), or cpu.table_gemv under an AVX-512 target (Q4_0, Q4_1 at one token),
  or for Q8_0, Q5_0, Q4_K, Q6_K under an AVX-512 target cpu.unpack_gemv (one token) and
  cpu.unpack_gemm (several; its products in bfloat16 where the target has AVX512-BF16), or cpu.dot_gemv (one token, int8 dot products; AVX-512 VNNI) where a
  plan asks for it;
- CUDA: a decode batch (symbolic, `few_tokens`) of Q4_0, Q4_1 or Q8_0 blocks with float16
  activations runs the tensor-core GEMV of gemv_mma.py (`uses_mma_gemv`); GEMV_FORMATS for one
  token, or another decode batch, the GEMV of gemv_cuda.py (`uses_cuda_gemv`); a prompt's GEMM
  (more tokens than a GEMV takes, not a decode batch) is two kernels, `dequantizes_first`: dequantize_algorithm writes W in the
  activations' dtype, and the model multiplies by it with float32 sums (dlight's Matmul rule on
  tensor cores); everything else, matmul_algorithm / take_algorithm under dlight's
  rules (`_schedule_cuda`).
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import tirx

from ..compiler.targets import cuda_target, target_has_avx512
from .algorithms import dequantize_algorithm, gemv_algorithm, matmul_algorithm, take_algorithm
from .config import QuantMatmulConfig
from .cpu import (CPUSchedule, choose_schedule, dot_gemv, schedule_llvm, table_gemv, target_has_bf16, target_has_vnni,
                  unpack_gemm, unpack_gemv)
from .gemv_cuda import GEMV_FORMATS, choose_gemv_schedule, gemv_kernel
from .gemv_mma import MMA_GEMV_FORMATS, choose_mma_gemv_layouts, mma_gemv_kernel


def _schedule_cuda(func: tirx.PrimFunc, config: QuantMatmulConfig) -> tirx.PrimFunc:
    """matmul_algorithm / take_algorithm scheduled for CUDA. The dequantization is an injective
    producer of the product, the pattern dlight's GPU rules fuse (what MLC's q4f16 kernels
    rely on): one static token (decode) gets dlight's GEMV (each thread group walks whole rows of
    blocks, the weight dequantized in registers on its way into the dot product, the partial sums
    reduced across the threads); more tokens get dlight's Matmul (tiles of W dequantized into
    shared memory once per token tile); the embedding lookup a thread per element."""
    from tvm.s_tir import dlight as dl

    target = cuda_target()
    if config.op in ("take", "dequantize"):
        rules = [dl.gpu.Fallback()]
    elif config.tokens == 1:
        rules = [dl.gpu.GEMV(), dl.gpu.Fallback()]
    else:
        rules = [dl.gpu.Matmul(), dl.gpu.Fallback()]
    for rule in rules:
        scheduled = rule.apply(func, target, False)
        if isinstance(scheduled, list):
            scheduled = scheduled[0] if scheduled else None
        if scheduled is not None:
            return scheduled.mod["main"]
    raise ValueError(f"{config.name}: no CUDA schedule applies")


# gemv_cuda's decode-batch passes keep each weight block in registers but re-read X per token and
# row: weights above this size (a 30 MB Q8_0 LM head) keep dlight's Matmul for a batch where the
# tensor-core GEMV does not apply (float32 activations, Q5_0, the K-quants)
CUDA_GEMV_MAX_BATCH_WEIGHT_BYTES = 16 << 20


def uses_mma_gemv(config: QuantMatmulConfig) -> bool:
    """Whether `config` runs gemv_mma's tensor-core kernel: a CUDA decode batch (`few_tokens`) of a
    MMA_GEMV_FORMATS block type with float16 activations and no prologue, at any weight size."""
    return (config.target == "cuda" and config.op == "matmul" and config.few_tokens
            and config.fmt in MMA_GEMV_FORMATS and config.dtype == "float16" and config.prologue == "none")


def uses_cuda_gemv(config: QuantMatmulConfig) -> bool:
    """Whether `config` runs one of our CUDA GEMVs (which take a residual, and gemv_cuda's a
    prologue): gemv_mma's where `uses_mma_gemv`, else gemv_cuda's for a GEMV_FORMATS block type
    at one static token (decode; also a few static tokens) or a decode batch (`few_tokens`) whose
    weight is at most CUDA_GEMV_MAX_BATCH_WEIGHT_BYTES; else dlight's rules (`_schedule_cuda`)."""
    if config.target != "cuda" or config.op != "matmul" or config.fmt not in GEMV_FORMATS:
        return False
    if config.tokens is not None:
        return config.tokens <= 8
    if uses_mma_gemv(config):
        return True
    weight_bytes = sum(np.prod(shape) * np.dtype(dtype).itemsize for _, dtype, shape in config.part_shapes())
    return config.few_tokens and weight_bytes <= CUDA_GEMV_MAX_BATCH_WEIGHT_BYTES


# the most static tokens the fused GEMM (dlight's Matmul tiles over W dequantized in shared memory
# per token tile) keeps on CUDA: for more, dequantizing W once and multiplying on tensor cores wins
CUDA_FUSED_GEMM_MAX_TOKENS = 8
# the largest W dequantized whole (in the activations' dtype): a tied LM head (262k x 640 for
# Gemma 3, 128k x 2048 for Llama-3.2-1B) multiplies a prompt call's few last-token rows, for which
# a copy of the whole table is mostly waste, and its scratch would come out of KV-cache memory
CUDA_DEQUANTIZE_MAX_BYTES = 128 << 20


def dequantizes_first(config: QuantMatmulConfig) -> bool:
    """Whether the model computes `config`'s product as a dequantize kernel (W in the activations'
    dtype, QuantMatmulConfig(op="dequantize")) and a dense matmul: a CUDA matmul that is not the
    GEMV, over a symbolic token count that is not a decode batch (prefill, batch_prefill,
    batch_verify) or more than CUDA_FUSED_GEMM_MAX_TOKENS static tokens, whose W takes at most
    CUDA_DEQUANTIZE_MAX_BYTES dequantized. The fused kernel re-dequantizes every W tile for every
    token tile; dequantizing once costs a write and a read of W in float16, a fraction of a
    prompt's product."""
    if config.target != "cuda" or config.op != "matmul" or uses_cuda_gemv(config) or config.few_tokens:
        return False
    if config.n * config.k * np.dtype(config.dtype).itemsize > CUDA_DEQUANTIZE_MAX_BYTES:
        return False
    return config.tokens is None or config.tokens > CUDA_FUSED_GEMM_MAX_TOKENS


def _scheduled(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """`func` marked scheduled (the model pipeline's dlight rules leave it alone) and opaque (never fused)."""
    return func.with_attr("tirx.is_scheduled", True).with_attr("op_pattern", 8)


def schedule(func: tirx.PrimFunc, config: QuantMatmulConfig, plan: CPUSchedule | None = None) -> tirx.PrimFunc:
    """`func` (from matmul_algorithm / take_algorithm of `config`) scheduled for config.target,
    marked scheduled (the model pipeline's dlight rules leave it alone) and opaque (never fused).
    Compile it for `compiler.targets.host_target()`: LLVM generates code for the target's CPU (a
    plain "llvm" target is SSE2, which splits every vector into 4-lane pieces)."""
    if config.target == "cuda":
        return _scheduled(_schedule_cuda(func, config))
    return _scheduled(schedule_llvm(func, config, plan or choose_schedule(config)))


def algorithm(config: QuantMatmulConfig, plan: CPUSchedule | None) -> tirx.PrimFunc:
    """The unscheduled PrimFunc `schedule` expects for `config`: take_algorithm, dequantize_algorithm, on llvm
    gemv_algorithm (one static token, with the plan's lanes), else matmul_algorithm."""
    if config.op == "take":
        return take_algorithm(config)
    if config.op == "dequantize":
        return dequantize_algorithm(config)
    if config.target == "llvm" and config.tokens == 1:
        return gemv_algorithm(config, (plan or choose_schedule(config)).lanes)
    return matmul_algorithm(config)


def kernel(config: QuantMatmulConfig, plan: CPUSchedule | None = None) -> tirx.PrimFunc:
    """The scheduled PrimFunc of `config`: arguments as algorithms.py's (X, *parts, Y) or
    (ids, *parts, E); the CUDA GEMV's residual and prologue arguments: gemv_cuda.py."""
    if config.residual and not uses_cuda_gemv(config):
        raise ValueError(f"{config.name}: residual=True needs the CUDA GEMV (uses_cuda_gemv)")
    if config.prologue != "none" and not uses_cuda_gemv(config):
        raise ValueError(f"{config.name}: prologue={config.prologue!r} needs the CUDA GEMV (uses_cuda_gemv)")
    if uses_mma_gemv(config):
        narrow, wide = choose_mma_gemv_layouts(config.n, config.k)
        func = mma_gemv_kernel(config.fmt, config.n, config.k, config.dtype, narrow, residual=config.residual,
                               wide=wide)
        return _scheduled(func).with_attr("global_symbol", config.name)
    if uses_cuda_gemv(config):
        func = gemv_kernel(config.fmt, config.n, config.k, config.tokens, config.dtype,
                           choose_gemv_schedule(config.n, config.k, config.tokens, config.prologue, config.fmt),
                           residual=config.residual, prologue=config.prologue, eps=config.eps)
        return _scheduled(func).with_attr("global_symbol", config.name)
    if config.target == "llvm":
        plan = plan or choose_schedule(config)
        if plan.lookup and config.op == "matmul" and config.tokens == 1:
            scope = tvm.target.Target.current(allow_none=True)
            if scope is not None and not target_has_avx512(scope):
                raise ValueError(f"{config.name}: plan.lookup needs an AVX-512 target, the scope's is {scope}")
            return _scheduled(table_gemv(config, plan)).with_attr("global_symbol", config.name)
        if plan.dot and config.op == "matmul" and config.tokens == 1:
            scope = tvm.target.Target.current(allow_none=True)
            if scope is not None and not target_has_vnni(scope):
                raise ValueError(f"{config.name}: plan.dot needs an AVX-512 VNNI target, the scope's is {scope}")
            return _scheduled(dot_gemv(config, plan)).with_attr("global_symbol", config.name)
        if plan.unpack and config.op == "matmul":
            scope = tvm.target.Target.current(allow_none=True)
            if scope is not None and not target_has_avx512(scope):
                raise ValueError(f"{config.name}: plan.unpack needs an AVX-512 target, the scope's is {scope}")
            if plan.bf16 and scope is not None and not target_has_bf16(scope):
                raise ValueError(f"{config.name}: plan.bf16 needs an AVX512-BF16 target, the scope's is {scope}")
            func = unpack_gemv(config, plan) if config.tokens == 1 else unpack_gemm(config, plan)
            return _scheduled(func).with_attr("global_symbol", config.name)
    return schedule(algorithm(config, plan), config, plan).with_attr("global_symbol", config.name)
