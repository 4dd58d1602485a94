"""Kernel configuration: what a generated kernel computes, validated at construction.

`AttentionConfig` fixes the shapes, dtype, page size, target and RoPE variant of a
kernel. It says nothing about tiling or thread mapping: that is the job of the
schedule classes in `tir_kernels.schedules`.
"""

from __future__ import annotations

import dataclasses
import math

import tvm

from .support import MAX_HEAD_DIM, TargetName, dtype_problem, is_fp8, kv_dtype_problem, page_size_problem


def _fail(field: str, value, allowed: str) -> None:
    raise ValueError(f"{field}={value!r} is not supported: expected {allowed}")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style RoPE frequency scaling (`rope_type="llama3"` in HF configs)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __post_init__(self):
        if self.factor <= 0:
            _fail("rope_scaling.factor", self.factor, "a positive number")
        if self.high_freq_factor <= self.low_freq_factor:
            _fail(
                "rope_scaling.high_freq_factor",
                self.high_freq_factor,
                f"a value above low_freq_factor={self.low_freq_factor}",
            )
        if self.original_max_position_embeddings <= 0:
            _fail(
                "rope_scaling.original_max_position_embeddings",
                self.original_max_position_embeddings,
                "a positive integer",
            )

    @classmethod
    def from_hf(cls, rope_scaling: dict | None) -> "RopeScaling | None":
        """Build from a Hugging Face `rope_scaling` dict; None or type "default" means none."""
        if not rope_scaling:
            return None
        kind = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
        if kind == "default":
            return None
        if kind != "llama3":
            _fail("rope_scaling.rope_type", kind, '"llama3" or "default"')
        return cls(
            factor=float(rope_scaling["factor"]),
            low_freq_factor=float(rope_scaling["low_freq_factor"]),
            high_freq_factor=float(rope_scaling["high_freq_factor"]),
            original_max_position_embeddings=int(rope_scaling["original_max_position_embeddings"]),
        )


class PageFormat:
    """The pages' element type of a config with `dtype` and `kv_dtype` fields."""

    @property
    def page_dtype(self) -> str:
        """The element type of the pages: kv_dtype, or dtype where kv_dtype is ""."""
        return self.kv_dtype or self.dtype

    @property
    def kv_fp8(self) -> bool:
        """Whether the pages hold FP8 codes (tir_kernels.kv_quant)."""
        return is_fp8(self.kv_dtype)


@dataclasses.dataclass(frozen=True)
class AttentionConfig(PageFormat):
    """What a kernel computes.

    num_qo_heads / num_kv_heads: query and key/value heads (GQA group = their ratio).
    head_dim: query/key head dim; v_head_dim: value/output head dim (defaults to head_dim).
    dtype: element type of q, k, v, o and the pages ("float16", "bfloat16", "float32").
    page_size: tokens per page (a power of two, 1..128).
    target: "llvm" or "cuda" (optionally "cuda:sm_90").
    sliding_window: paged kernels read `length_info` as [3, batch] (last_page_len,
      sliding_window_offset, sink_size) instead of [batch].
    rope_theta / rope_scale: constants of the split-rotary kernel (attention kernels take
      them at run time); rope_scaling: optional Llama-3 frequency scaling, used everywhere.
    kv_dtype: element type of the pages ("" = dtype); an FP8 format ("float8_e4m3fn",
      "float8_e5m2") stores codes that the kernels dequantize with the scales held in the
      pool's last page (tir_kernels.kv_quant).
    """

    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int = 0
    dtype: str = "float16"
    page_size: int = 16
    target: str = "llvm"
    sliding_window: bool = False
    rope_theta: float = 10000.0
    rope_scale: float = 1.0
    rope_scaling: RopeScaling | None = None
    kv_dtype: str = ""

    def __post_init__(self):
        if self.v_head_dim == 0:
            object.__setattr__(self, "v_head_dim", self.head_dim)
        _check_kv_dtype(self)
        for field in ("num_qo_heads", "num_kv_heads"):
            value = getattr(self, field)
            if not isinstance(value, int) or value <= 0:
                _fail(field, value, "a positive integer")
        if self.num_qo_heads % self.num_kv_heads:
            _fail(
                "num_kv_heads",
                self.num_kv_heads,
                f"a divisor of num_qo_heads={self.num_qo_heads}",
            )
        for field in ("head_dim", "v_head_dim"):
            value = getattr(self, field)
            if not isinstance(value, int) or value <= 0 or value % 16 or value > MAX_HEAD_DIM:
                _fail(field, value, f"a multiple of 16 from 16 to {MAX_HEAD_DIM}")
        for field, problem in (("dtype", dtype_problem), ("page_size", page_size_problem)):
            expected = problem(getattr(self, field))
            if expected:
                _fail(field, getattr(self, field), expected)
        TargetName.parse(self.target)  # raises ValueError naming the target
        if self.rope_theta <= 0:
            _fail("rope_theta", self.rope_theta, "a positive number")
        if self.rope_scale <= 0:
            _fail("rope_scale", self.rope_scale, "a positive number")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            _fail("rope_scaling", self.rope_scaling, "a RopeScaling or None")

    # Derived facts, named so kernels read clearly.
    @property
    def group_size(self) -> int:
        return self.num_qo_heads // self.num_kv_heads

    @property
    def is_gpu(self) -> bool:
        return TargetName.parse(self.target).is_cuda

    @property
    def elem_bytes(self) -> int:
        return tvm.runtime.DataType(self.dtype).bits // 8

    @property
    def cuda_arch(self) -> str:
        return TargetName.parse(self.target).cuda_arch

    @property
    def sm_version(self) -> int:
        """The CUDA compute capability as a number (90 for "sm_90" and "sm_90a"); 0 on the CPU."""
        return int(self.cuda_arch[3:].rstrip("a")) if self.is_gpu else 0

    def tvm_target(self) -> tvm.target.Target:
        """The TVM target this config builds for."""
        return tvm_target(self.target)

    def replace(self, **changes) -> "AttentionConfig":
        return dataclasses.replace(self, **changes)


# The largest latent (output) width of an MLA kernel: the split-merge kernel gives each output
# column a thread, and CUDA blocks have at most 1024.
MAX_MLA_LATENT_DIM = 1024


@dataclasses.dataclass(frozen=True)
class MLAConfig(PageFormat):
    """What an MLA (multi-head latent attention, DeepSeek-V2/V3) kernel computes.

    Every head attends to the same cached row per token: the latent vector (latent_dim values,
    also the value) followed by the rotary key part (rope_dim values). Queries are "absorbed"
    (already projected into that space), so q has latent_dim + rope_dim values per head and the
    output latent_dim. The defaults are DeepSeek-V2/V3's (latent 512, rope 64); num_heads is 128
    for V2/V3 and 16 for V2-Lite.

    num_heads: query heads (all share the one latent row).
    latent_dim: latent rank, the output width (a multiple of 16, at most MAX_MLA_LATENT_DIM).
    rope_dim: width of the rotary key part (a multiple of 16 up to MAX_HEAD_DIM, may be 0).
    dtype, page_size, target, kv_dtype: as in AttentionConfig. Pages are [num_pages, page_size,
    qk_dim]; with an FP8 kv_dtype a layer has two scales, one for the latent columns and one for
    the rotary ones (tir_kernels.kv_quant).
    """

    num_heads: int
    latent_dim: int = 512
    rope_dim: int = 64
    dtype: str = "float16"
    page_size: int = 16
    target: str = "llvm"
    kv_dtype: str = ""

    def __post_init__(self):
        _check_kv_dtype(self)
        if not isinstance(self.num_heads, int) or isinstance(self.num_heads, bool) or self.num_heads <= 0:
            _fail("num_heads", self.num_heads, "a positive integer")
        latent = self.latent_dim
        if not isinstance(latent, int) or latent <= 0 or latent % 16 or latent > MAX_MLA_LATENT_DIM:
            _fail("latent_dim", latent, f"a multiple of 16 from 16 to {MAX_MLA_LATENT_DIM}")
        rope = self.rope_dim
        if not isinstance(rope, int) or rope < 0 or rope % 16 or rope > MAX_HEAD_DIM:
            _fail("rope_dim", rope, f"a multiple of 16 from 0 to {MAX_HEAD_DIM}")
        for field, problem in (("dtype", dtype_problem), ("page_size", page_size_problem)):
            expected = problem(getattr(self, field))
            if expected:
                _fail(field, getattr(self, field), expected)
        TargetName.parse(self.target)  # raises ValueError naming the target

    @property
    def qk_dim(self) -> int:
        """Values per cached row and per query head: latent_dim + rope_dim."""
        return self.latent_dim + self.rope_dim

    # TVM's cache names the output shape of an MLA layer as it does an MHA one's (o [n,
    # num_qo_heads, v_head_dim]); with these names `merge_state(mla_config)` (merge.py) merges MLA
    # outputs at the latent width (512 for DeepSeek, beyond AttentionConfig's head-dim limit).
    @property
    def num_qo_heads(self) -> int:
        return self.num_heads

    @property
    def v_head_dim(self) -> int:
        return self.latent_dim

    @property
    def is_gpu(self) -> bool:
        return TargetName.parse(self.target).is_cuda

    @property
    def elem_bytes(self) -> int:
        return tvm.runtime.DataType(self.dtype).bits // 8

    @property
    def cuda_arch(self) -> str:
        return TargetName.parse(self.target).cuda_arch

    def tvm_target(self) -> tvm.target.Target:
        """The TVM target this config builds for."""
        return tvm_target(self.target)

    def replace(self, **changes) -> "MLAConfig":
        return dataclasses.replace(self, **changes)


def _check_kv_dtype(config) -> None:
    """kv_dtype: "" (the activation dtype), that dtype, or an FP8 format over fp16/bf16/f32."""
    if config.kv_dtype in ("", config.dtype):
        object.__setattr__(config, "kv_dtype", "")
        return
    if not is_fp8(config.kv_dtype):
        problem = kv_dtype_problem(config.kv_dtype) or f"{config.dtype!r} (the dtype) or an FP8 format"
        _fail("kv_dtype", config.kv_dtype, problem)


def tvm_target(target: str, *, schedule_rules: bool = False) -> tvm.target.Target:
    """The TVM target of a target string ("llvm", "cuda", "cuda:sm_XY"; see tir_kernels.support).

    schedule_rules: also state the CUDA limits that dlight's schedule rules read (a model
    library's matmuls and norms are scheduled by dlight; an arch-only target makes it warn and
    guess). The attention kernels carry their own schedules and build with the arch alone.
    """
    name = TargetName.parse(target)
    if not name.is_cuda:
        return tvm.target.Target("llvm")
    if not schedule_rules:
        return tvm.target.Target({"kind": "cuda", "arch": name.cuda_arch})
    return tvm.target.Target({"kind": "cuda", "arch": name.cuda_arch, "max_threads_per_block": 1024,
                              "max_num_threads": 1024, "thread_warp_size": 32,
                              "max_shared_memory_per_block": 49152, "registers_per_block": 65536})


def default_sm_scale(head_dim: int) -> float:
    """The usual softmax scale 1/sqrt(head_dim)."""
    return 1.0 / math.sqrt(head_dim)
