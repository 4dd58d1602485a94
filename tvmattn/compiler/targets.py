"""The targets kernels compile for: the host CPU's llvm target and the CUDA target whose limits
(threads, shared memory) the schedules read.

An llvm library is compiled for the host's CPU (`host_target`): a plain "llvm" target is SSE2,
which splits every vector into 4-lane pieces. AVX-512 is opt-in (`host_target(avx512=True)`).
"""

from __future__ import annotations

import functools

import tvm


@functools.lru_cache(maxsize=1)
def host_cpu() -> tuple[str, int]:
    """(LLVM name of this machine's CPU, float32 lanes of the vectors we compile for: 8 with AVX2, else 4)."""
    from tvm.target import codegen

    cpu = codegen.llvm_get_system_cpu()
    features = codegen.llvm_get_cpu_features(tvm.target.Target({"kind": "llvm", "mcpu": cpu}))
    return cpu, 8 if "avx2" in features else 4


@functools.lru_cache(maxsize=1)
def host_has_avx512() -> bool:
    """Whether this machine's CPU has AVX-512F (the 16-entry vector lookup of quant.cpu.table_gemv)."""
    return target_has_avx512(tvm.target.Target({"kind": "llvm", "mcpu": host_cpu()[0]}))


def host_target(avx512: bool = False, bf16: bool = True) -> tvm.target.Target:
    """The llvm target of this machine's CPU (its instructions; 256-bit vectors at most unless
    `avx512` and the CPU has AVX-512).

    AVX-512 is for libraries whose every matrix is kept quantized (models.export.BuildOptions.
    host_avx512): it gives the 4-bit GEMV its 16-entry vector lookup (quant.cpu.table_gemv), but
    LLVM takes minutes instead of seconds with it on dlight's float matmuls in the same library
    (compile times: docs/performance.md).
    Kernels pick the lookup from the target in scope (`target_has_avx512`). bf16=False turns off
    AVX512-BF16 (the prefill GEMMs of kept blocks then multiply in float32: quant.cpu.unpack_gemm)."""
    if avx512 and host_has_avx512():
        if not bf16:
            return tvm.target.Target({"kind": "llvm", "mcpu": host_cpu()[0], "mattr": ["-avx512bf16"]})
        return tvm.target.Target({"kind": "llvm", "mcpu": host_cpu()[0]})
    return tvm.target.Target({"kind": "llvm", "mcpu": host_cpu()[0], "mattr": ["-avx512f"]})


def llvm_features(target: tvm.target.Target | None) -> frozenset[str]:
    """The CPU features an llvm `target` (None: the one in scope, if any) generates code for;
    none for another target or none in scope."""
    from tvm.target import codegen

    target = target or tvm.target.Target.current(allow_none=True)
    if target is None or target.kind.name != "llvm":
        return frozenset()
    return frozenset(str(feature) for feature in codegen.llvm_get_cpu_features(target))


def target_has_avx512(target: tvm.target.Target | None) -> bool:
    """Whether an llvm `target` (None: the one in scope, if any) generates AVX-512F code."""
    return "avx512f" in llvm_features(target)


def cuda_target() -> tvm.target.Target:
    """The CUDA target the schedules read their limits from (threads, shared memory): the
    current one when a CUDA target is in scope, else sm_90's."""
    current = tvm.target.Target.current(allow_none=True)
    if current is not None and current.kind.name == "cuda":
        return current
    return tvm.target.Target({"kind": "cuda", "arch": "sm_90", "max_shared_memory_per_block": 49152,
                              "max_threads_per_block": 1024, "thread_warp_size": 32})

