"""Batched prefill attention (many query tokens per request), MHA/GQA: the choice of kernel.

Three kernels compute the contract's prefills (paged, ragged and their token-tree forms), below
this module: prefill_sm90 (wgmma, Hopper), prefill_sm80 (mma.sync, sm_80 and newer) and
prefill_simt (CUDA cores and the CPU). `choose_prefill_kernel` says which one serves a config,
and why the faster ones were passed over; each public function here builds that kernel's
PrimFunc. All of them take the same arguments and have the same semantics and global symbol.
"""

from __future__ import annotations

from .config import AttentionConfig
from .prefill_simt import paged_prefill_simt, ragged_prefill_simt, tree_paged_prefill_simt, tree_ragged_prefill_simt
from .prefill_sm80 import (MmaPrefillSchedule, mma_problem, paged_prefill_mma, ragged_prefill_mma,
                           tree_paged_prefill_mma, tree_ragged_prefill_mma)
from .prefill_sm90 import (paged_prefill_wgmma, ragged_prefill_wgmma, tree_paged_prefill_wgmma,
                           tree_ragged_prefill_wgmma, wgmma_problem)
from .schedules import PrefillSchedule, WgmmaPrefillSchedule
from .support import KernelChoice

# kernel -> its generators: (paged, ragged, token-tree paged, token-tree ragged)
_GENERATORS = {
    "prefill_sm90": (paged_prefill_wgmma, ragged_prefill_wgmma, tree_paged_prefill_wgmma, tree_ragged_prefill_wgmma),
    "prefill_sm80": (paged_prefill_mma, ragged_prefill_mma, tree_paged_prefill_mma, tree_ragged_prefill_mma),
    "prefill": (paged_prefill_simt, ragged_prefill_simt, tree_paged_prefill_simt, tree_ragged_prefill_simt),
}
PAGED, RAGGED, TREE_PAGED, TREE_RAGGED = range(4)
# Why FP8 pages (config.kv_dtype) take the CUDA-core kernel: it dequantizes each element as it
# stages K/V; the tensor-core kernels copy fp16/bf16 tiles with cp.async and have no FP8 path yet.
FP8_TC_PROBLEM = "FP8 K/V pages are read by the CUDA-core kernel (the tensor-core prefills have no FP8 path)"


def choose_prefill_kernel(config: AttentionConfig, schedule=None) -> KernelChoice:
    """The kernel that serves `config` (a key of support.CAPABILITIES), and why the faster ones
    were passed over. A schedule picks its kernel (WgmmaPrefillSchedule: prefill_sm90,
    MmaPrefillSchedule: prefill_sm80, PrefillSchedule: the CUDA-core one); without one, Hopper
    (sm_90) fp16/bf16 configs get the wgmma kernel, sm_80..sm_89 ones (and Hopper ones whose head
    dims wgmma does not tile, e.g. 80) the mma.sync kernel; float32, older archs and the CPU the
    CUDA-core kernel. FP8 pages (config.kv_dtype) are read by the CUDA-core kernel
    (FP8_TC_PROBLEM); the ragged forms read no pages and choose as for the dtype's pages."""
    if schedule is not None:
        if isinstance(schedule, (WgmmaPrefillSchedule, MmaPrefillSchedule)) and config.kv_fp8:
            raise ValueError(f"kv_dtype={config.kv_dtype!r} is not supported by {type(schedule).__name__}:"
                             " expected a PrefillSchedule (the CUDA-core kernel)")
        if isinstance(schedule, WgmmaPrefillSchedule):
            return KernelChoice("prefill_sm90")
        return KernelChoice("prefill_sm80" if isinstance(schedule, MmaPrefillSchedule) else "prefill")
    if config.kv_fp8:
        return KernelChoice("prefill", FP8_TC_PROBLEM)
    wgmma = wgmma_problem(config)
    if wgmma is None:
        return KernelChoice("prefill_sm90")
    mma = mma_problem(config)
    if mma is None:
        return KernelChoice("prefill_sm80", f"wgmma: {wgmma}")
    return KernelChoice("prefill", f"wgmma: {wgmma}; mma.sync: {mma}")


def _generator(config: AttentionConfig, schedule, form: int):
    return _GENERATORS[choose_prefill_kernel(config, schedule).kernel][form]


def _pageless(config: AttentionConfig) -> AttentionConfig:
    """The config of a ragged form: it reads K/V from its arguments, never from FP8 pages."""
    return config.replace(kv_dtype="") if config.kv_fp8 else config


def paged_prefill(config: AttentionConfig, schedule: PrefillSchedule | None = None):
    """Paged-KV prefill PrimFunc, arguments in the contract's order:

    q [total_q, Hq, D], qo_indptr [B+1] i32, pages [P, 2, Hkv, page_size, D],
    page_indptr [B+1] i32, page_indices [nnz] i32, length_info [B] i32 (or [3, B] when
    sliding: last_page_len, sliding_window_offset, sink_size), k_rope_pos_offset [B] i32,
    q_rope_position [total_q] i32, o [total_q, Hq, D], lse [total_q, Hq] f32 (base 2),
    causal i32, rotary_mode i32, rope_scale f32, rope_theta f32, sm_scale f32.
    The KV of request b is its visible paged tokens; causal query i of qo_len sees keys
    j <= kv_len - qo_len + i. Rows that see no key get o = 0 and lse = EMPTY_LSE.
    fp16/bf16 configs on sm_80 and newer get a tensor-core kernel (see `choose_prefill_kernel`)
    unless a CUDA-core `PrefillSchedule` is passed.
    """
    return _generator(config, schedule, PAGED)(config, schedule)


def ragged_prefill(config: AttentionConfig, schedule: PrefillSchedule | None = None):
    """Ragged-KV prefill PrimFunc (K/V packed over the batch), arguments in the contract's order:

    q [total_q, Hq, Dqk], qo_indptr [B+1] i32, k [total_kv, Hkv, Dqk], v [total_kv, Hkv, Dv],
    kv_indptr [B+1] i32, q_rope_position [total_q] i32, k_rope_pos_offset [B] i32,
    o [total_q, Hq, Dv], lse [total_q, Hq] f32 (base 2), causal i32, rotary_mode i32,
    rope_scale f32, rope_theta f32, sm_scale f32. Dqk = config.head_dim, Dv = config.v_head_dim.
    Key j of request b is row kv_indptr[b] + j, at RoPE position k_rope_pos_offset[b] + j.
    fp16/bf16 configs on sm_80 and newer get a tensor-core kernel as in `paged_prefill`.
    """
    config = _pageless(config)
    return _generator(config, schedule, RAGGED)(config, schedule)


def tree_mask_paged_prefill(config: AttentionConfig, schedule: PrefillSchedule | None = None):
    """Token-tree attention over paged K/V (speculative decoding): TVM's `tree_attn_paged_kv`
    arguments (see prefill_contract.tree_paged_prefill_func). A request's queries are the last
    nodes of its token tree, which are the last keys of its paged sequence; a query node sees
    the committed history, its ancestors and itself (masks.TreeMask). fp16/bf16 configs on
    sm_80 and newer run on tensor cores as in `paged_prefill` (`choose_prefill_kernel`); keys
    are cached rotated (rotary_mode must be 0)."""
    if config.sliding_window:
        raise ValueError("sliding_window=True is not supported by tree_mask_paged_prefill: token trees need the"
                         " whole sequence (expected sliding_window=False)")
    if config.v_head_dim != config.head_dim:
        raise ValueError(f"v_head_dim={config.v_head_dim} is not supported by tree_mask_paged_prefill: expected"
                         f" head_dim={config.head_dim}")
    return _generator(config, schedule, TREE_PAGED)(config, schedule)


def tree_mask_ragged_prefill(config: AttentionConfig, schedule: PrefillSchedule | None = None):
    """Token-tree attention over ragged K/V (the tree's own nodes as keys): TVM's
    `batch_tree_attn` arguments (see prefill_contract.tree_ragged_prefill_func); a query node
    sees its ancestors and itself (masks.TreeMask). Tensor cores as in `tree_mask_paged_prefill`."""
    config = _pageless(config)
    return _generator(config, schedule, TREE_RAGGED)(config, schedule)
