"""The dispatchers' choice of kernel: which kernel serves a config, why the faster ones were
passed over, and agreement with the capability table (tir_kernels.support.CAPABILITIES).

No kernel is compiled: the choices are made from the config alone.
"""

import pytest

from tir_kernels import (
    CAPABILITIES,
    AttentionConfig,
    DecodeSchedule,
    MLAConfig,
    MLASchedule,
    TensorCoreDecodeSchedule,
    choose_decode_kernel,
    choose_mla_prefill_kernel,
    choose_prefill_kernel,
)
from tir_kernels.mla import choose_mla_decode_default
from tir_kernels.prefill_sm80 import MmaPrefillSchedule
from tir_kernels.schedules import PrefillSchedule, WgmmaPrefillSchedule

TARGETS = ("llvm", "cuda:sm_75", "cuda:sm_80", "cuda:sm_86", "cuda:sm_90", "cuda:sm_90a")
DTYPES = ("float16", "bfloat16", "float32")


def assert_served(choice, config):
    """The chosen kernel's capabilities cover the config's dtype and target."""
    cap = CAPABILITIES[choice.kernel]
    assert config.dtype in cap.dtypes, (choice, config)
    assert cap.serves_target(config.target), (choice, config)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", (64, 80, 128, 256))
def test_prefill_choice(target, dtype, head_dim):
    """wgmma on Hopper fp16/bf16 with head dims of whole 64-column panels, else mma.sync on
    sm_80+ fp16/bf16, else CUDA cores; a fallback says why."""
    config = AttentionConfig(16, 4, head_dim, dtype=dtype, target=target)
    choice = choose_prefill_kernel(config)
    assert_served(choice, config)
    tensor_cores = dtype != "float32" and target not in ("llvm", "cuda:sm_75")
    hopper = tensor_cores and target.startswith("cuda:sm_90") and head_dim % 64 == 0
    expected = "prefill_sm90" if hopper else "prefill_sm80" if tensor_cores else "prefill"
    assert choice.kernel == expected
    assert (choice.reason is None) == (expected == "prefill_sm90")
    if expected == "prefill":
        assert "wgmma" in choice.reason and "mma.sync" in choice.reason


def test_prefill_schedule_names_the_kernel():
    """A schedule picks its kernel, with no fallback reason."""
    config = AttentionConfig(16, 4, 128, dtype="float16", target="cuda:sm_90")
    assert choose_prefill_kernel(config, WgmmaPrefillSchedule(tile_kv=64, stages=2)) == ("prefill_sm90", None)
    assert choose_prefill_kernel(config, MmaPrefillSchedule()) == ("prefill_sm80", None)
    core = PrefillSchedule(threads_y=16, threads_x=8, rows_per_thread=4, cols_per_thread=4)
    assert choose_prefill_kernel(config, core) == ("prefill", None)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kv_heads", (1, 2, 4, 8, 16))
def test_decode_choice(target, dtype, kv_heads):
    """Tensor cores for fp16/bf16 GQA groups of 4..16 on sm_80+ (32 query heads: groups 32..2 are
    outside, 16..4 inside); otherwise CUDA cores, with the reason."""
    config = AttentionConfig(32, kv_heads, 128, dtype=dtype, target=target)
    choice = choose_decode_kernel(config)
    assert_served(choice, config)
    group = 32 // kv_heads
    tensor_cores = dtype != "float32" and target not in ("llvm", "cuda:sm_75") and 4 <= group <= 16
    assert choice.kernel == ("decode_tc" if tensor_cores else "decode")
    assert isinstance(choice.schedule, TensorCoreDecodeSchedule if tensor_cores else DecodeSchedule)
    assert (choice.reason is None) == tensor_cores
    if not tensor_cores:
        assert choice.rope_schedule is None


@pytest.mark.parametrize("target", ("cuda:sm_80", "cuda:sm_86", "cuda:sm_90"))
@pytest.mark.parametrize("head_dim, tensor_cores", [(32, True), (48, False), (64, True), (80, False), (96, False),
                                                    (112, False), (128, True), (192, False), (240, False),
                                                    (256, True)])
def test_decode_choice_by_head_dim(target, head_dim, tensor_cores):
    """The tensor-core decode's inline RoPE rotates whole K rows per pass of its 128 threads,
    over head_dim / 16 chunk pairs a row (schedules.tc_rope_pass_problem): head dims whose pairs
    do not divide the threads, or whose rows a pass does not divide the 64-key tile, run on CUDA
    cores (80 and 96 among them), and the choice says why; a tensor-core schedule asked for
    there is a ValueError naming the head dim, not an assertion inside the kernel."""
    config = AttentionConfig(32, 8, head_dim, dtype="float16", target=target)
    choice = choose_decode_kernel(config)
    assert_served(choice, config)
    assert choice.kernel == ("decode_tc" if tensor_cores else "decode")
    if not tensor_cores:
        assert f"head_dim={head_dim}: the tensor-core decode's inline RoPE" in choice.reason
        with pytest.raises(ValueError, match=f"head_dim={head_dim}: the tensor-core decode's inline RoPE"):
            TensorCoreDecodeSchedule(warps=4, keys_per_warp=16).check(config)


def test_decode_off_switch_falls_back_with_reason(monkeypatch):
    """With the tensor-core decode switched off, a config it would serve runs on CUDA cores and
    the choice says why."""
    from tir_kernels import decode

    config = AttentionConfig(32, 8, 128, dtype="float16", target="cuda:sm_90")
    monkeypatch.setattr(decode, "TENSOR_CORE_DECODE", False)
    choice = choose_decode_kernel(config)
    assert choice.kernel == "decode" and isinstance(choice.schedule, DecodeSchedule)
    assert "TENSOR_CORE_DECODE" in choice.reason


def test_decode_schedule_names_the_kernel():
    config = AttentionConfig(32, 8, 128, dtype="float16", target="cuda:sm_90")
    tc = TensorCoreDecodeSchedule()
    assert choose_decode_kernel(config, tc) == ("decode_tc", tc, None, None)
    core = DecodeSchedule(lanes=16, rows=8, rows_per_thread=2, heads_per_block=4)
    assert choose_decode_kernel(config, core, tc) == ("decode", core, None, None)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("latent", (160, 512))
def test_mla_choices(target, dtype, latent):
    """MLA prefill: wgmma on Hopper fp16/bf16 with latent_dim a multiple of 128, else the SIMT
    kernel; MLA decode (default build): mma.sync on sm_80+ fp16/bf16 (latent_dim a multiple of
    32), else SIMT; every fallback says why."""
    config = MLAConfig(16, latent, 64, dtype=dtype, target=target)
    prefill, decode = choose_mla_prefill_kernel(config), choose_mla_decode_default(config)
    assert_served(prefill, config)
    assert_served(decode, config)
    tensor_cores = dtype != "float32" and target not in ("llvm", "cuda:sm_75")
    hopper = tensor_cores and target.startswith("cuda:sm_90") and latent % 128 == 0
    assert prefill.kernel == ("mla_sm90" if hopper else "mla")
    assert (prefill.reason is None) == hopper
    assert decode.kernel == ("mla_tc" if tensor_cores else "mla")
    assert (decode.reason is None) == tensor_cores
    simt = MLASchedule(threads_y=16, threads_x=16, rows_per_thread=1, cols_per_thread=2)
    assert choose_mla_prefill_kernel(config, simt) == ("mla", None)


def test_capability_targets():
    """serves_target: CPU kernels run on llvm; min_sm bounds the CUDA archs; archs lists them."""
    assert CAPABILITIES["decode"].serves_target("llvm") and CAPABILITIES["decode"].serves_target("cuda:sm_75")
    assert not CAPABILITIES["decode_tc"].serves_target("llvm")
    assert not CAPABILITIES["decode_tc"].serves_target("cuda:sm_75")
    assert CAPABILITIES["decode_tc"].serves_target("cuda:sm_80")
    assert CAPABILITIES["prefill_sm90"].serves_target("cuda:sm_90a")
    assert not CAPABILITIES["prefill_sm90"].serves_target("cuda:sm_100")
