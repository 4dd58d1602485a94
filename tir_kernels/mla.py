"""MLA (multi-head latent attention, DeepSeek-V2/V3): the choice of kernel, and the public names.

An MLA layer caches one row per token, shared by every head: the latent vector (latent_dim
values) followed by the rotary key part (rope_dim values), in pages
`[num_pages, page_size, qk_dim]` (TVM's MLA layout, qk_dim = latent_dim + rope_dim). Queries
are absorbed: q [n, heads, qk_dim]; o [n, heads, latent_dim]; LSE is base 2 (docs/design.md).

Three kernels compute the contract's MLA attention, below this module: mla_simt.py on CUDA
cores and the CPU (decode and prefill, `mla_paged_decode` is its decode), mla_tc.py on mma.sync
tensor cores (decode, sm_80 and newer) and mla_sm90.py on wgmma (decode and prefill, Hopper).
`choose_mla_prefill_kernel`, `choose_mla_decode_default` and `choose_mla_decode_kernel` say
which serves a config (and a decode batch), and why the faster ones were passed over. The page
operations of the MLA pool are mla_page_ops.py's.
"""

from __future__ import annotations

import functools

from .common import ceildiv
from .config import MLAConfig
from .mla_page_ops import mla_copy_single_page, mla_debug_get_kv, mla_transpose_append
from .mla_simt import MLASchedule, choose_mla_schedule, mla_paged_decode, mla_paged_prefill_simt
from .mla_sm90 import (MLAWgmmaDecodeSplit, MLAWgmmaSchedule, mla_paged_prefill_wgmma, mla_wgmma_decode_problem,
                       mla_wgmma_problem)
from .mla_tc import mla_paged_decode_tc, mla_tc_problem
from .schedules import CUDA_NUM_SMS
from .support import KernelChoice

# Speed of one CTA of mla_sm90's wgmma decode (all of a request's keys for 64 heads) over that of
# an SM running mla_tc's split decode, on the same rows, for launches of one CTA per request and
# head tile: "full" where every row of the 64-head tile is a head, "partial" where the tile is
# partly empty (16 heads: a quarter of its rows used). Measured on the H200 (docs/performance.md).
WGMMA_DECODE_SPEEDUP = {"full": 1.6, "partial": 1.0}
# Largest batch at which the split wgmma decode (2 or more split CTAs per request and head tile)
# runs instead of mla_tc: with full tiles it won at every batch measured, with partial tiles only
# at small batches (docs/performance.md).
WGMMA_SPLIT_DECODE_MAX_BATCH = {"full": CUDA_NUM_SMS, "partial": 8}


def choose_mla_prefill_kernel(config: MLAConfig, schedule=None) -> KernelChoice:
    """The kernel of `mla_paged_prefill(config, schedule)`: "mla_sm90" (wgmma) for an
    MLAWgmmaSchedule, or without a schedule where `mla_sm90.mla_wgmma_problem` finds none (Hopper
    fp16/bf16 configs with an even latent split, DeepSeek's 512 + 64); else "mla" (mla_simt.py),
    with the reason where the wgmma kernel was passed over."""
    if isinstance(schedule, MLAWgmmaSchedule):
        return KernelChoice("mla_sm90")
    if schedule is not None or not isinstance(config, MLAConfig):
        return KernelChoice("mla")
    problem = mla_wgmma_problem(config)
    if problem is None:
        return KernelChoice("mla_sm90")
    return KernelChoice("mla", f"wgmma: {problem}")


def mla_paged_prefill(config: MLAConfig, schedule: MLASchedule | MLAWgmmaSchedule | None = None):
    """MLA paged prefill PrimFunc, arguments in the contract's order:

    q [total_q, H, qk_dim], qo_indptr [B+1] i32, pages [P, page_size, qk_dim],
    page_indptr [B+1] i32, page_indices [nnz] i32, length_info [B] i32 (slots used in the last
    page), o [total_q, H, latent_dim], lse [total_q, H] f32 (base 2), causal i32, sm_scale f32.
    With causal != 0, query i of a request's qo_len sees latent rows j <= kv_len - qo_len + i
    (absolute positions); else all of them. Rows that see none get o = 0 and lse = EMPTY_LSE.
    (TVM's cache calls it with causal = 0 for MLA cross-attention over the cached history, for
    decode too.)

    The kernel is `choose_mla_prefill_kernel(config, schedule)`'s: Hopper fp16/bf16 configs with
    an even latent split get the tensor-core kernel (`mla_sm90`) unless `schedule` is an
    `MLASchedule`; an `MLAWgmmaSchedule` asks for it.
    """
    if choose_mla_prefill_kernel(config, schedule).kernel == "mla_sm90":
        return mla_paged_prefill_wgmma(config, schedule)
    return mla_paged_prefill_simt(config, schedule)


def choose_mla_decode_default(config: MLAConfig) -> KernelChoice:
    """The kernel of `mla_paged_decode_auto(config)`: "mla_tc" where `mla_tc.mla_tc_problem` finds
    none, else "mla" (the SIMT kernel: the CPU, float32, older GPUs), with the reason."""
    problem = mla_tc_problem(config)
    return KernelChoice("mla_tc") if problem is None else KernelChoice("mla", f"mma.sync: {problem}")


def mla_paged_decode_auto(config: MLAConfig):
    """The MLA decode kernel for `config` (`choose_mla_decode_default`): tensor cores where
    `mla_tc.supports_tc`, else the SIMT kernel of mla_simt.py (the CPU, float32, older GPUs)."""
    if choose_mla_decode_default(config).kernel == "mla_tc":
        return mla_paged_decode_tc(config)
    return mla_paged_decode(config)


@functools.lru_cache(maxsize=4096)
def choose_mla_decode_kernel(config: MLAConfig, batch: int) -> str:
    """Which built MLA decode serves a call of `batch` requests: "wgmma" (mla_sm90, split-KV
    chosen at launch), "tc" (mla_tc's split decode, which fills every SM) or "simt"
    (mla_simt.py). Where the wgmma decode splits (2 or more CTAs per request and head tile), wgmma
    up to WGMMA_SPLIT_DECODE_MAX_BATCH; where it does not (one CTA per request and head tile, in
    waves of one an SM), wgmma where its waves, each WGMMA_DECODE_SPEEDUP times faster than an
    SM of the split kernel, take less time than the split kernel's even share of the same CTAs'
    rows. Cached per (config, batch): the cache asks on every decode call."""
    if mla_tc_problem(config) is not None:
        return "simt"
    if batch < 1 or mla_wgmma_decode_problem(config) is not None:
        return "tc"
    head_tiles = ceildiv(config.num_heads, 64)
    tiles = batch * head_tiles
    kind = "full" if config.num_heads % 64 == 0 else "partial"
    if MLAWgmmaDecodeSplit().slots(batch, head_tiles) > 1:
        return "wgmma" if batch <= WGMMA_SPLIT_DECODE_MAX_BATCH[kind] else "tc"
    return "wgmma" if ceildiv(tiles, CUDA_NUM_SMS) / WGMMA_DECODE_SPEEDUP[kind] < tiles / CUDA_NUM_SMS else "tc"


__all__ = ["MLASchedule", "WGMMA_DECODE_SPEEDUP", "WGMMA_SPLIT_DECODE_MAX_BATCH", "choose_mla_decode_default",
           "choose_mla_decode_kernel", "choose_mla_prefill_kernel", "choose_mla_schedule", "mla_copy_single_page",
           "mla_debug_get_kv", "mla_paged_decode", "mla_paged_decode_auto", "mla_paged_prefill",
           "mla_transpose_append"]
