"""FP8 KV scales from a prompt set: `calibrate_kv_scales(generator, prompts)`.

The scale of (layer, K or V, KV head) is amax / FP8_MAX[kv_dtype] over every token of the
prompts (amax: the largest |value| of that head's K or V rows), so the largest value seen maps
to the format's largest finite code (448 for e4m3fn); a head that only ever held zeros keeps
1.0. K is measured as the cache stores it (after RoPE). Per-tensor amax scaling is what vLLM and
FlashInfer calibrate. `headroom` multiplies the scales: values beyond the calibration set's
largest saturate, and a long text reaches values well above a few short prompts' amax, while a
larger scale costs almost nothing, since the relative precision of a normal FP8 value does not
depend on the scale (only values below scale * the smallest normal, 2^-6 for e4m3fn, lose
precision). `percentile` below 100 maps a percentile instead of the amax to FP8_MAX, saturating
the tail on purpose.

Run it on a generator of the same model whose cache keeps K/V unquantized (a library compiled
without --kv-cache-dtype): its pages hold the exact K/V. Then give the scales to the FP8
library's generator (`Generator.kv_scales = scales`) or to a PagedKVCache (`kv_scales=`).
On an FP8 library's generator it measures the FP8-rounded K/V of a cache at the generator's
scales (1.0 by default), raising the scale of every head whose values reached the format's
largest code (saturated, so its amax was not seen) and measuring again.

An MLA (DeepSeek) library's cache holds one latent row per token and layer, [c, k_pe]: its
scales are [num_layers, 2, 1], index 0 the latent columns' scale (c, also the values; amax over
the first latent_dim columns) and index 1 the rope columns' (k_pe after RoPE; amax over the
last rope_dim columns), measured the same way (`kv_scales_shape` gives a library's shape).

`save_kv_scales` / `load_kv_scales`: the scales as a file (.npy, or .json: a nested list), what
`python -m tvmattn calibrate-kv` writes and `generate --kv-scales` reads.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import tvm

from tir_kernels.support import FP8_MAX, is_fp8


def calibrate_kv_scales(generator, prompts: list[list[int]] | list[str], kv_dtype: str = "float8_e4m3fn",
                        chunk: int | None = None, percentile: float = 100.0, headroom: float = 1.0) -> np.ndarray:
    """float32 [num_layers, 2, num_kv_heads] scales for `kv_dtype` from the K/V that `generator`'s
    model computes over `prompts` (token lists, or strings encoded as chat prompts); an MLA
    library's: [num_layers, 2, 1], its latent and its rope columns' scales. Each prompt is
    prefilled (in chunks of `chunk` tokens, default the library's) into a sequence of the
    generator's cache, read back with debug_get_kv (debug_get_kv_mla), and removed. `percentile` (0, 100]: the
    head's largest |value| (100, amax) or that percentile of its |values| maps to FP8_MAX / headroom
    (headroom >= 1: room for values beyond those of the prompts); values above it saturate."""
    if not is_fp8(kv_dtype):
        raise ValueError(f"kv_dtype={kv_dtype!r} is not supported: expected one of {tuple(FP8_MAX)}")
    if isinstance(percentile, bool) or not isinstance(percentile, (int, float)) or not 0 < percentile <= 100:
        raise ValueError(f"percentile={percentile!r} is not supported: expected a number in (0, 100]")
    if isinstance(headroom, bool) or not isinstance(headroom, (int, float)) or not 1 <= headroom < float("inf"):
        raise ValueError(f"headroom={headroom!r} is not supported: expected a finite number >= 1")
    if not prompts:
        raise ValueError("prompts must hold at least one prompt")
    token_lists = [generator.encode(p) if isinstance(p, str) else list(p) for p in prompts]
    session = getattr(generator, "session", generator)  # a Generator or its ModelSession
    spec = session.metadata["kv_cache"]
    if not is_fp8(spec.get("kv_dtype")):
        amax = _measure(generator, session, token_lists, chunk, percentile)
    else:
        # an FP8 cache holds K/V / scale rounded and saturated at FP8_MAX: a head whose amax
        # reached FP8_MAX * scale may hold larger values, so its scale grows until none does
        limit = FP8_MAX[spec["kv_dtype"]]
        given = session.kv_scales
        trial = np.ones(kv_scales_shape(spec)) if given is None else np.array(given, np.float64)
        try:
            for _ in range(8):
                session.kv_scales = trial.astype(np.float32)
                peak = _measure(generator, session, token_lists, chunk, 100.0)
                saturated = peak >= limit * trial * (1 - 1e-6)
                if not saturated.any():
                    break
                trial = np.where(saturated, trial * 256.0, trial)
            amax = peak if percentile == 100 else _measure(generator, session, token_lists, chunk, percentile)
        finally:
            session.kv_scales = given
    scales = np.where(amax > 0, amax * headroom / FP8_MAX[kv_dtype], 1.0)
    return scales.astype(np.float32)


def is_mla(spec: dict) -> bool:
    """A library's metadata["kv_cache"] describes an MLA (latent) cache."""
    return spec.get("attention") == "mla"


def kv_scales_shape(spec: dict) -> tuple[int, int, int]:
    """The FP8 scales' shape of a library's cache (metadata["kv_cache"]): (num_layers, 2,
    num_kv_heads), or (num_layers, 2, 1) for an MLA cache (latent, rope)."""
    return (spec["num_layers"], 2, 1 if is_mla(spec) else spec["num_kv_heads"])


def load_library_kv_scales(path, spec: dict) -> np.ndarray:
    """load_kv_scales for the library whose metadata["kv_cache"] is `spec` (MLA or not)."""
    layers, _, heads = kv_scales_shape(spec)
    return load_kv_scales(path, layers, heads, mla=is_mla(spec))


def _measure(generator, session, token_lists: list[list[int]], chunk: int | None, percentile: float) -> np.ndarray:
    """float64 [layers, 2, heads]: the percentile of |K| and |V| per head over the prompts (an
    MLA cache: [layers, 2, 1], of its latent and its rope columns), from a cache of the session's
    own (the generator's is dropped: it makes another on its next call)."""
    spec = session.metadata["kv_cache"]
    if is_mla(spec):
        return _measure_mla(generator, session, token_lists, chunk, percentile)
    layers, heads, dim = spec["num_layers"], spec["num_kv_heads"], spec["head_dim"]
    seen: list[list[np.ndarray]] = [[], []]  # per K/V: |values| [layers, tokens * dim, heads] per prompt

    def read(seq: int, n: int) -> None:
        k = tvm.runtime.empty((layers, n, heads, dim), spec["dtype"], device=session.device)
        v = tvm.runtime.empty((layers, n, heads, dim), spec["dtype"], device=session.device)
        tvm.get_global_func("tvmattn.attention_kv_cache_debug_get_kv")(session.cache, seq, 0, n, k, v)
        for index, values in ((0, k), (1, v)):
            magnitude = np.abs(values.numpy().astype(np.float64)).transpose(0, 1, 3, 2)
            seen[index].append(magnitude.reshape(layers, -1, heads))

    _prefill_each(generator, session, token_lists, chunk, read)
    return np.stack([np.percentile(np.concatenate(part, axis=1), percentile, axis=1) for part in seen], axis=1)


def _prefill_each(generator, session, token_lists: list[list[int]], chunk: int | None, read) -> None:
    """Prefill each prompt (in chunks) into sequence 0 of a new cache of the session's, call
    read(seq, n) while it is cached, remove it; the session keeps no cache afterwards."""
    chunk = chunk or session.prefill_chunk
    page = session.settings["page_size"]
    longest = max(len(t) for t in token_lists)
    if hasattr(generator, "runner"):
        generator.runner = None  # the calibration's cache replaces the generator's
    session.create_cache(1, -(-longest // page) * page + page)
    try:
        for tokens in token_lists:
            session.add_sequence(0)
            try:
                for begin in range(0, len(tokens), chunk):
                    piece = tokens[begin:begin + chunk]
                    session.forward("prefill", [0], [len(piece)], session.embed(piece)[None])
                read(0, len(tokens))
            finally:
                session.remove_sequence(0)
    finally:
        session.cache, session.cache_tokens = None, 0


def _measure_mla(generator, session, token_lists: list[list[int]], chunk: int | None,
                 percentile: float) -> np.ndarray:
    """float64 [layers, 2, 1]: the percentile of |latent| (columns below latent_dim) and of
    |k_pe| (the rope columns) per layer, read back with debug_get_kv_mla."""
    spec = session.metadata["kv_cache"]
    layers, latent, width = spec["num_layers"], spec["latent_dim"], spec["latent_dim"] + spec["rope_dim"]
    seen: list[list[np.ndarray]] = [[], []]  # latent / rope: |values| [layers, tokens * columns] per prompt

    def read(seq: int, n: int) -> None:
        kv = tvm.runtime.empty((layers, n, width), spec["dtype"], device=session.device)
        tvm.get_global_func("tvmattn.attention_kv_cache_debug_get_kv_mla")(session.cache, seq, 0, n, kv)
        magnitude = np.abs(kv.numpy().astype(np.float64))
        seen[0].append(magnitude[:, :, :latent].reshape(layers, -1))
        seen[1].append(magnitude[:, :, latent:].reshape(layers, -1))

    _prefill_each(generator, session, token_lists, chunk, read)
    amax = [np.percentile(np.concatenate(part, axis=1), percentile, axis=1) if part[0].shape[1] else np.zeros(layers)
            for part in seen]
    return np.stack(amax, axis=1)[:, :, None]


def save_kv_scales(path, scales) -> None:
    """Write scales [layers, 2, kv_heads] to `path`: .npy (float32) or .json (nested lists)."""
    path, scales = Path(path), np.asarray(scales, np.float32)
    if path.suffix == ".json":
        path.write_text(json.dumps(scales.tolist()) + "\n")
    elif path.suffix == ".npy":
        np.save(path, scales)
    else:
        raise ValueError(f"kv scales file {str(path)!r}: expected a name ending in .npy or .json")


def load_kv_scales(path, num_layers: int, num_kv_heads: int, mla: bool = False) -> np.ndarray:
    """float32 [num_layers, 2, num_kv_heads] read from a .npy or .json file (mla: an MLA cache's
    [num_layers, 2, 1], latent and rope scales; num_kv_heads must be 1); ValueError naming the
    file when it is unreadable, of another shape, or holds a value that is not finite and > 0."""
    path = Path(path)
    if mla and num_kv_heads != 1:
        raise ValueError(f"num_kv_heads={num_kv_heads!r}: an MLA cache's scales are [num_layers, 2, 1]")
    expected = [num_layers, 2, num_kv_heads]
    names = "[layers, 2, 1] (latent, rope)" if mla else "[layers, 2, kv_heads]"
    try:
        if path.suffix == ".json":
            scales = np.array(json.loads(path.read_text()), dtype=np.float64)
        elif path.suffix == ".npy":
            scales = np.load(path, allow_pickle=False)
        else:
            raise ValueError("expected a name ending in .npy or .json")
    except (OSError, ValueError, TypeError) as err:
        reason = err.strerror if isinstance(err, OSError) and err.strerror else str(err).splitlines()[0]
        raise ValueError(f"kv scales file {str(path)!r}: {reason}") from None
    if scales.dtype.kind not in "fiu" or list(scales.shape) != expected:
        raise ValueError(f"kv scales file {str(path)!r}: expected numbers of shape {names} = "
                         f"{expected}, got {scales.dtype} {list(scales.shape)}")
    scales = scales.astype(np.float64)
    if not (np.isfinite(scales).all() and (scales > 0).all()):
        raise ValueError(f"kv scales file {str(path)!r}: every scale must be finite and positive")
    return scales.astype(np.float32)
