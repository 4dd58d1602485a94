"""Independent float64 numpy references for every kernel (no TVM, no torch).

Conventions follow docs/design.md: LSE is base 2 (m + log2(d) with scores scaled by
sm_scale * log2(e)); a query row that sees no key has o = 0 and lse = EMPTY_LSE.
"""

from __future__ import annotations

import math

import numpy as np

EMPTY_LSE = -5.0e4

# (rtol, atol) for outputs in each dtype; kernels accumulate in fp32, so the error is
# the output rounding of the dtype plus fp32 accumulation noise.
TOLERANCES = {
    "float32": (1e-4, 1e-4),
    "float16": (4e-3, 4e-3),
    "bfloat16": (2.5e-2, 2.5e-2),
}
LSE_TOLERANCE = (1e-3, 2e-3)


def attention(q, k, v, sm_scale: float, causal: bool, visible=None):
    """Attention of one request.

    q [qo_len, Hq, D], k [kv_len, Hkv, D], v [kv_len, Hkv, Dv] (any float dtype).
    Query i sees key j when not causal, or when j <= kv_len - qo_len + i; or, when given,
    when visible[i, j] (a [qo_len, kv_len] bool mask, e.g. `tree_visibility`).
    Returns o [qo_len, Hq, Dv] float64 and lse [qo_len, Hq] float64 (base 2).
    """
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    qo_len, hq, _ = q.shape
    kv_len, hkv, dv = v.shape
    group = hq // hkv
    o = np.zeros((qo_len, hq, dv))
    lse = np.full((qo_len, hq), EMPTY_LSE)
    if kv_len == 0 or qo_len == 0:
        return o, lse
    k_per_head = np.repeat(k, group, axis=1)  # [kv_len, Hq, D]
    v_per_head = np.repeat(v, group, axis=1)
    scores = np.einsum("qhd,khd->hqk", q, k_per_head) * sm_scale * math.log2(math.e)
    if visible is None:
        visible = np.ones((qo_len, kv_len), dtype=bool)
        if causal:
            visible = np.arange(kv_len)[None, :] <= (kv_len - qo_len + np.arange(qo_len))[:, None]
    scores = np.where(visible[None], scores, -np.inf)
    row_max = scores.max(axis=-1, keepdims=True)
    has_key = np.isfinite(row_max)
    weights = np.where(has_key, np.exp2(scores - np.where(has_key, row_max, 0)), 0.0)
    denom = weights.sum(axis=-1, keepdims=True)
    out = np.einsum("hqk,khd->qhd", weights / np.where(denom > 0, denom, 1), v_per_head)
    row_lse = (row_max + np.log2(np.where(denom > 0, denom, 1)))[..., 0].T  # [qo_len, Hq]
    rows = has_key[..., 0].T
    o[rows] = out[rows]
    lse[rows] = row_lse[rows]
    return o, lse


def rope_inv_freq(rotary_dim: int, theta: float, scaling=None):
    """Inverse frequencies [rotary_dim/2], with optional Llama-3 scaling (HF's definition)."""
    inv_freq = 1.0 / theta ** (np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim)
    if scaling is None:
        return inv_freq
    wavelen = 2 * math.pi / inv_freq
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    return np.where(wavelen < high_wavelen, inv_freq, np.where(wavelen > low_wavelen, inv_freq / scaling.factor, blended))


def rope(x, positions, theta: float = 1e4, scale: float = 1.0, scaling=None):
    """Rotate-half RoPE over the whole head dim. x [n, H, D], positions [n] -> float64."""
    x = np.asarray(x, dtype=np.float64)
    d = x.shape[-1]
    angles = (np.asarray(positions, dtype=np.float64) * scale)[:, None] * rope_inv_freq(d, theta, scaling)[None]
    cos = np.concatenate([np.cos(angles)] * 2, axis=-1)[:, None, :]
    sin = np.concatenate([np.sin(angles)] * 2, axis=-1)[:, None, :]
    rotated = np.concatenate([-x[..., d // 2 :], x[..., : d // 2]], axis=-1)
    return x * cos + rotated * sin


def merge_states(o1, lse1, o2, lse2):
    """Combine two partial attention results over disjoint key sets (base-2 LSE)."""
    o1, o2 = np.asarray(o1, np.float64), np.asarray(o2, np.float64)
    lse1, lse2 = np.asarray(lse1, np.float64), np.asarray(lse2, np.float64)
    m = np.maximum(lse1, lse2)
    w1, w2 = np.exp2(lse1 - m), np.exp2(lse2 - m)
    o = (o1 * w1[..., None] + o2 * w2[..., None]) / (w1 + w2)[..., None]
    return o, m + np.log2(w1 + w2)


def tree_visibility(parents, history: int, qo_len: int) -> np.ndarray:
    """[qo_len, history + n] bool: which keys each query node of a token tree sees.

    parents[i]: node i's parent (-1: a root; parents come before children); the keys are
    `history` committed tokens then the n tree nodes; the queries are the last qo_len nodes.
    A query sees the history, its ancestors (walked through `parents`) and itself.
    """
    n = len(parents)
    seen = np.zeros((qo_len, history + n), dtype=bool)
    seen[:, :history] = True
    for row, node in enumerate(range(n - qo_len, n)):
        while node >= 0:
            seen[row, history + node] = True
            node = parents[node]
    return seen


def dfs_intervals(parents) -> np.ndarray:
    """[n, 2] int32: each node's DFS interval [begin, end) (TVM's tree_attn_mask layout): node
    k is an ancestor of node q, or q itself, exactly when begin[k] <= begin[q] < end[k]."""
    n = len(parents)
    children = [[] for _ in range(n)]
    roots = []
    for i, p in enumerate(parents):
        (roots if p < 0 else children[p]).append(i)
    out = np.zeros((n, 2), np.int32)
    counter = 0
    stack = [(r, False) for r in reversed(roots)]
    while stack:
        node, done = stack.pop()
        if done:
            out[node, 1] = counter
            continue
        out[node, 0] = counter
        counter += 1
        stack.append((node, True))
        stack.extend((c, False) for c in reversed(children[node]))
    return out
