"""The demo: build paged prefill and paged decode, run them on a small batch, check them.

Two requests with ragged lengths are laid into a page pool with shuffled page ids, as a
paged KV cache would hold them. Request 0 already has a cached prefix and prefills a
chunk of new tokens; request 1 prefills a whole prompt. Then both decode one token. Each
kernel's output `o` and base-2 `lse` are compared with a float64 numpy reference written
here (the package does not import the tests).
"""

from __future__ import annotations

import math
import time

import numpy as np
import tvm

from tir_kernels import AttentionConfig, build, default_sm_scale, paged_decode, paged_prefill
from tir_kernels.support import numpy_dtype

NUM_QO_HEADS = 32
NUM_KV_HEADS = 8
HEAD_DIM = 128
# (tokens already cached, new tokens to prefill) per request.
REQUESTS = ((20, 25), (0, 19))
SPARE_PAGES = 2

# (rtol, atol) on o per dtype and on the base-2 lse: fp32 accumulation, output rounded to dtype.
O_TOLERANCE = {"float16": (4e-3, 4e-3), "bfloat16": (2.5e-2, 2.5e-2), "float32": (1e-4, 1e-4)}
LSE_TOLERANCE = (1e-3, 2e-3)


def reference_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, sm_scale: float, causal: bool):
    """float64 attention of one request with base-2 LSE.

    q [qo_len, Hq, D], k/v [kv_len, Hkv, D]; causal: query i sees key j <= kv_len - qo_len + i.
    Returns o [qo_len, Hq, D] and lse [qo_len, Hq] (every row in the demo sees a key).
    """
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    scores = np.einsum("qhd,khd->hqk", q, k) * sm_scale * math.log2(math.e)
    if causal:
        qo_len, kv_len = q.shape[0], k.shape[0]
        visible = np.arange(kv_len)[None, :] <= (kv_len - qo_len + np.arange(qo_len))[:, None]
        scores = np.where(visible[None], scores, -np.inf)
    row_max = scores.max(axis=-1, keepdims=True)
    weights = np.exp2(scores - row_max)
    denom = weights.sum(axis=-1, keepdims=True)
    o = np.einsum("hqk,khd->qhd", weights / denom, v)
    lse = (row_max + np.log2(denom))[..., 0].T
    return o, lse


class _PagePool:
    """K/V of every request in a page pool [P, 2, Hkv, page_size, D] with shuffled page ids."""

    def __init__(self, rng: np.random.Generator, lengths, config: AttentionConfig):
        ps = config.page_size
        self.page_size = ps
        self.pages_per_request = [-(-n // ps) for n in lengths]
        total = sum(self.pages_per_request) + SPARE_PAGES
        self.pages = np.zeros((total, 2, config.num_kv_heads, ps, config.head_dim), numpy_dtype(config.dtype))
        order = rng.permutation(total)
        starts = np.cumsum([0] + self.pages_per_request)
        self.page_ids = [order[starts[i] : starts[i + 1]] for i in range(len(lengths))]
        self.lengths = list(lengths)

    def write(self, request: int, position: int, k: np.ndarray, v: np.ndarray) -> None:
        """Store K/V [Hkv, D] of token `position` of `request`."""
        page = self.page_ids[request][position // self.page_size]
        self.pages[page, 0, :, position % self.page_size] = k
        self.pages[page, 1, :, position % self.page_size] = v

    def page_table(self, lengths):
        """(page_indptr, page_indices, last_page_len) for requests of the given visible lengths."""
        indptr, indices, last = [0], [], []
        for ids, n in zip(self.page_ids, lengths):
            used = -(-n // self.page_size)
            indices.extend(ids[:used].tolist())
            indptr.append(len(indices))
            last.append(n - (used - 1) * self.page_size if used else 0)
        return (np.array(indptr, np.int32), np.array(indices, np.int32), np.array(last, np.int32))


def _device(config: AttentionConfig) -> tvm.runtime.Device:
    if not config.is_gpu:
        return tvm.cpu(0)
    device = tvm.cuda(0)
    if not device.exist:
        raise ValueError(f"target={config.target!r} needs a CUDA device and none was found")
    return device


def _timed_build(generator, config: AttentionConfig):
    start = time.perf_counter()
    kernel = build(generator(config), config)
    return kernel, time.perf_counter() - start


def _errors(config: AttentionConfig, o, lse, o_ref, lse_ref) -> dict:
    rtol, atol = O_TOLERANCE[config.dtype]
    lse_rtol, lse_atol = LSE_TOLERANCE
    o_err, lse_err = np.abs(o - o_ref), np.abs(lse - lse_ref)
    passed = bool(np.all(o_err <= atol + rtol * np.abs(o_ref)) and np.all(lse_err <= lse_atol + lse_rtol * np.abs(lse_ref)))
    return {
        "o_max_abs_err": float(o_err.max()),
        "lse_max_abs_err": float(lse_err.max()),
        "o_tolerance": (rtol, atol),
        "lse_tolerance": LSE_TOLERANCE,
        "passed": passed,
    }


def run_demo(dtype: str = "float16", page_size: int = 16, target: str = "llvm", seed: int = 0) -> dict:
    """Build and check paged_prefill and paged_decode on a small ragged batch.

    Returns {"config": {...}, "requests": [(cached, new), ...], "kernels": {name: {"build_seconds",
    "o_max_abs_err", "lse_max_abs_err", "o_tolerance", "lse_tolerance", "passed"}}, "passed": bool}.
    Raises ValueError for an unsupported dtype/page size/target or a CUDA target without a GPU.
    """
    config = AttentionConfig(NUM_QO_HEADS, NUM_KV_HEADS, HEAD_DIM, dtype=dtype, page_size=page_size, target=target)
    device = _device(config)
    np_dtype = numpy_dtype(dtype)
    sm_scale = default_sm_scale(HEAD_DIM)
    rng = np.random.default_rng(seed)

    def randn(*shape):
        return rng.standard_normal(shape).astype(np_dtype)

    def tensor(array):
        return tvm.runtime.tensor(np.ascontiguousarray(array), device=device)

    def outputs(rows):
        o = tvm.runtime.tensor(np.full((rows, NUM_QO_HEADS, HEAD_DIM), np.nan, np_dtype), device=device)
        lse = tvm.runtime.tensor(np.full((rows, NUM_QO_HEADS), np.nan, np.float32), device=device)
        return o, lse

    prefill_lengths = [cached + new for cached, new in REQUESTS]
    decode_lengths = [n + 1 for n in prefill_lengths]
    pool = _PagePool(rng, decode_lengths, config)
    keys = [randn(n, NUM_KV_HEADS, HEAD_DIM) for n in decode_lengths]
    values = [randn(n, NUM_KV_HEADS, HEAD_DIM) for n in decode_lengths]
    for i, n in enumerate(prefill_lengths):
        for pos in range(n):
            pool.write(i, pos, keys[i][pos], values[i][pos])
    kernels = {}

    # Prefill: the new tokens of each request attend causally to the cached prefix and themselves.
    prefill, build_seconds = _timed_build(paged_prefill, config)
    new_tokens = [new for _, new in REQUESTS]
    qo_indptr = np.cumsum([0] + new_tokens).astype(np.int32)
    q = randn(int(qo_indptr[-1]), NUM_QO_HEADS, HEAD_DIM)
    indptr, indices, last = pool.page_table(prefill_lengths)
    o, lse = outputs(q.shape[0])
    zeros_b, zeros_q = np.zeros(len(REQUESTS), np.int32), np.zeros(q.shape[0], np.int32)
    prefill(tensor(q), tensor(qo_indptr), tensor(pool.pages), tensor(indptr), tensor(indices), tensor(last),
            tensor(zeros_b), tensor(zeros_q), o, lse, 1, 0, 1.0, 1e4, sm_scale)
    refs = [reference_attention(q[qo_indptr[i] : qo_indptr[i + 1]], keys[i][:n], values[i][:n], sm_scale, causal=True)
            for i, n in enumerate(prefill_lengths)]
    kernels["paged_prefill"] = {
        "build_seconds": build_seconds,
        **_errors(config, o.numpy().astype(np.float64), lse.numpy(),
                  np.concatenate([r[0] for r in refs]), np.concatenate([r[1] for r in refs])),
    }

    # Decode: append one token to each request, then attend with one query each.
    decode, build_seconds = _timed_build(paged_decode, config)
    for i, n in enumerate(prefill_lengths):
        pool.write(i, n, keys[i][n], values[i][n])
    q = randn(len(REQUESTS), NUM_QO_HEADS, HEAD_DIM)
    indptr, indices, last = pool.page_table(decode_lengths)
    o, lse = outputs(q.shape[0])
    decode(tensor(q), tensor(pool.pages), tensor(indptr), tensor(indices), tensor(last), tensor(zeros_b),
           tensor(zeros_b), o, lse, 0, 1.0, 1e4, sm_scale)
    refs = [reference_attention(q[i : i + 1], keys[i], values[i], sm_scale, causal=False) for i in range(len(REQUESTS))]
    kernels["paged_decode"] = {
        "build_seconds": build_seconds,
        **_errors(config, o.numpy().astype(np.float64), lse.numpy(),
                  np.concatenate([r[0] for r in refs]), np.concatenate([r[1] for r in refs])),
    }

    return {
        "config": {"num_qo_heads": NUM_QO_HEADS, "num_kv_heads": NUM_KV_HEADS, "head_dim": HEAD_DIM,
                   "dtype": dtype, "page_size": page_size, "target": target},
        "requests": list(REQUESTS),
        "kernels": kernels,
        "passed": all(k["passed"] for k in kernels.values()),
    }


def format_report(report: dict) -> str:
    """Human-readable summary of `run_demo`'s result."""
    cfg = report["config"]
    lines = [
        f"tvmattn demo: {cfg['num_qo_heads']} q / {cfg['num_kv_heads']} kv heads, head_dim {cfg['head_dim']}, "
        f"{cfg['dtype']}, page_size {cfg['page_size']}, target {cfg['target']}",
        "requests (cached, new): " + ", ".join(f"({c}, {n})" for c, n in report["requests"]) + "; then one decode step",
    ]
    for name, k in report["kernels"].items():
        lines.append(
            f"  {name:<14} build {k['build_seconds']:6.2f} s   max|o err| {k['o_max_abs_err']:.2e} "
            f"(atol {k['o_tolerance'][1]:g})   max|lse err| {k['lse_max_abs_err']:.2e}   "
            + ("ok" if k["passed"] else "FAILED")
        )
    lines.append("PASSED" if report["passed"] else "FAILED: error above the dtype's tolerance")
    return "\n".join(lines)
