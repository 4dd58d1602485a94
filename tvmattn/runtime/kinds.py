"""Per-layer attention kinds (TVM's AttnKind, attn_utils.h) and the check of a cache's layer list.

A cache's layers are MHA (multi-head attention over the cache's pages), MHA_SLIDING (MHA over
the layer's last `layer_sliding_window_size` tokens: a per-layer sliding window while other
layers see everything), or MLA (multi-head latent attention: one latent row per token shared
by all heads, pages [num_pages, page_size, qk_head_dim]). LINEAR (TVM's linear attention) has
no implementation, in TVM either.
"""

from __future__ import annotations

import enum
import operator

from .errors import KVCacheError


class AttnKind(enum.IntEnum):
    """TVM's per-layer attention kinds (attn_utils.h), with their create-call values."""

    MHA = 0
    MLA = 1
    LINEAR = 2
    MHA_SLIDING = 3


def _kind(value, where: str) -> AttnKind:
    if isinstance(value, AttnKind):
        return value
    if isinstance(value, str):
        name = value.strip().upper()
        if name in AttnKind.__members__:
            return AttnKind[name]
    elif not isinstance(value, bool):
        try:
            return AttnKind(operator.index(value))
        except (TypeError, ValueError):
            pass
    names = ", ".join(f'"{k.name.lower()}" ({k.value})' for k in AttnKind)
    raise KVCacheError(f"{where} must be one of {names}, got {value!r}")


def parse_attn_kinds(value, num_layers: int) -> tuple[AttnKind, ...]:
    """The kind of every layer. value: None (every layer MHA), one kind for every layer, or one
    per layer; a kind is an AttnKind, its name ("mha", "mla", "mha_sliding") or TVM's integer.

    Refused (KVCacheError naming attn_kinds): a wrong count, unknown kinds, LINEAR, and MLA
    layers beside MHA ones (tvmattn's caches are all-MLA or MHA / MHA_SLIDING)."""
    if value is None:
        return (AttnKind.MHA,) * num_layers
    if isinstance(value, (str, AttnKind)):
        value = [value] * num_layers
    try:
        items = list(value)
    except TypeError:
        raise KVCacheError(f"attn_kinds must be a kind or a sequence of per-layer kinds, got {value!r}") from None
    if len(items) != num_layers:
        raise KVCacheError(f"attn_kinds has {len(items)} entries for num_layers={num_layers}: one per layer")
    kinds = tuple(_kind(item, f"attn_kinds[{i}]") for i, item in enumerate(items))
    if AttnKind.LINEAR in kinds:
        raise KVCacheError(f"attn_kinds[{kinds.index(AttnKind.LINEAR)}] is LINEAR: linear attention is not "
                           "supported (TVM's cache has no implementation of it either)")
    if AttnKind.MLA in kinds and set(kinds) != {AttnKind.MLA}:
        other = next(i for i, k in enumerate(kinds) if k != AttnKind.MLA)
        raise KVCacheError(f"attn_kinds mixes MLA layers with {kinds[other].name} (layer {other}): a tvmattn cache "
                           "is either every layer MLA or MHA / MHA_SLIDING layers (qk_head_dim and v_head_dim are "
                           "the cache's, and MLA's are the latent row's)")
    return kinds
