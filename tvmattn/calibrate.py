"""FP8 KV scales from a prompt set: `calibrate_kv_scales(generator, prompts)`.

The scale of (layer, K or V, KV head) is amax / FP8_MAX[kv_dtype] over every token of the
prompts (amax: the largest |value| of that head's K or V rows), so the largest value seen maps
to the format's largest finite code (448 for e4m3fn) and nothing seen saturates; a head that
only ever held zeros keeps 1.0. K is measured as the cache stores it (after RoPE). Per-tensor
amax scaling is what vLLM and FlashInfer calibrate; a margin is not added because saturation
clips only values beyond the calibration set's largest, while a larger scale coarsens every
small value (the relative precision of a normal FP8 value does not depend on the scale, its
subnormal range does).

Run it on a generator of the same model whose cache keeps K/V unquantized (a library compiled
without --kv-cache-dtype): its pages hold the exact K/V. Then give the scales to the FP8
library's generator (`Generator.kv_scales = scales`) or to a PagedKVCache (`kv_scales=`).
"""

from __future__ import annotations

import numpy as np
import tvm

from tir_kernels.support import FP8_MAX, is_fp8


def calibrate_kv_scales(generator, prompts: list[list[int]] | list[str], kv_dtype: str = "float8_e4m3fn",
                        chunk: int | None = None) -> np.ndarray:
    """float32 [num_layers, 2, num_kv_heads] scales for `kv_dtype` from the K/V that `generator`'s
    model computes over `prompts` (token lists, or strings encoded as chat prompts). Each prompt is
    prefilled (in chunks of `chunk` tokens, default the library's) into a sequence of the
    generator's cache, read back with debug_get_kv, and removed."""
    if not is_fp8(kv_dtype):
        raise ValueError(f"kv_dtype={kv_dtype!r} is not supported: expected one of {tuple(FP8_MAX)}")
    if not prompts:
        raise ValueError("prompts must hold at least one prompt")
    token_lists = [generator.encode(p) if isinstance(p, str) else list(p) for p in prompts]
    session = getattr(generator, "session", generator)  # a Generator or its ModelSession
    spec = session.metadata["kv_cache"]
    layers, heads, dim = spec["num_layers"], spec["num_kv_heads"], spec["head_dim"]
    amax = np.zeros((layers, 2, heads), np.float64)
    chunk = chunk or session.prefill_chunk
    page = session.settings["page_size"]
    longest = max(len(t) for t in token_lists)
    if hasattr(generator, "runner"):
        generator.runner = None  # the calibration's cache replaces the generator's
    session.create_cache(1, -(-longest // page) * page + page)
    for tokens in token_lists:
        seq = 0
        session.add_sequence(seq)
        try:
            for begin in range(0, len(tokens), chunk):
                piece = tokens[begin:begin + chunk]
                session.forward("prefill", [seq], [len(piece)], session.embed(piece)[None])
            dtype = spec["dtype"]
            k = tvm.runtime.empty((layers, len(tokens), heads, dim), dtype, device=session.device)
            v = tvm.runtime.empty((layers, len(tokens), heads, dim), dtype, device=session.device)
            tvm.get_global_func("tvmattn.attention_kv_cache_debug_get_kv")(session.cache, seq, 0, len(tokens), k, v)
            for index, values in ((0, k), (1, v)):
                amax[:, index] = np.maximum(amax[:, index], np.abs(values.numpy().astype(np.float64)).max(axis=(1, 3)))
        finally:
            session.remove_sequence(seq)
    session.cache, session.cache_tokens = None, 0
    scales = np.where(amax > 0, amax / FP8_MAX[kv_dtype], 1.0)
    return scales.astype(np.float32)
