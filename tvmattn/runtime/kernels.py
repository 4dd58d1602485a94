"""The kernels a cache runs: tvmattn's own from `tir_kernels`, built once per process, or any
slot replaced by the caller (for example by TVM's own kernels or a model library's).

Slot names (the `kernels=` keys of PagedKVCache), with what each holds:
- attention kernels, as backend specs (`[]`, `["tir" | "tirx", f]`, `["flashinfer", ...]`, a
  function or a backend object; see backends.py): `prefill_ragged`, `prefill_paged`,
  `decode_paged`, `prefill_paged_sliding_window`, `decode_paged_sliding_window` (length_info
  [3, B]), `tree_attn_paged_kv`, `tree_attn_ragged`;
- auxiliary kernels, as functions with the contract's arguments: `transpose_append`,
  `split_rotary`, `copy_single_page`, `compact_copy`, `debug_get_kv`, `merge_state`;
- `split_rotary_append` (optional, not in TVM's contract): split_rotary and transpose_append in
  one launch (tir_kernels.split_rotary_append), run in decode and tree steps. Built only where
  neither split_rotary nor transpose_append is replaced (a replaced one must run as given).
- `decode_append` (optional, not in TVM's contract): split_rotary_append and the paged decode in
  one launch (tir_kernels.paged_decode_append), run by plain decode steps (one paged level,
  rope mode "normal" or "none") in place of those two. Built where split_rotary_append is and
  decode_paged is not replaced, for caches without sliding windows whose decode takes the
  tensor-core kernel (`tir_kernels.decode_append_problem`), as one function or a
  `DecodeByShape` over the decode's table variants.
- MLA caches (tvmattn.runtime.mla builds their set): `prefill_paged_mla` (TVM's mla_prefill),
  `decode_paged_mla` (ours, not in TVM's create call), `transpose_append_mla`, and
  `merge_attn_output` (TVM's second merge function, run by merge_attn_output_inplace); there
  `copy_single_page`, `debug_get_kv` and `merge_state` are the MLA layout's.

A cache with `support_sliding_window` runs the sliding-window variants for every sequence
(sink 0, offset 0 for a sequence without a window), as TVM's cache does; otherwise the plain
ones. A cache with MHA_SLIDING layers also runs `decode_paged_sliding_window` for those layers.
The tree-mask slots (run only by token-tree steps, which sliding-window caches refuse)
hold a `Deferred` that the cache builds on the first tree step. Slots the cache does not run
are left `[]` / None by `default_kernels`.
"""

from __future__ import annotations

import dataclasses
import functools

import tir_kernels
from tir_kernels import AttentionConfig

from .errors import KVCacheError

ATTENTION_SLOTS = (
    "prefill_ragged",
    "prefill_paged",
    "decode_paged",
    "prefill_paged_sliding_window",
    "decode_paged_sliding_window",
    "tree_attn_paged_kv",
    "tree_attn_ragged",
    "prefill_paged_mla",
    "decode_paged_mla",
)
FUNCTION_SLOTS = ("transpose_append", "split_rotary", "copy_single_page", "compact_copy", "debug_get_kv", "merge_state")
OPTIONAL_SLOTS = ("split_rotary_append", "decode_append", "transpose_append_mla", "merge_attn_output")
SLOTS = ATTENTION_SLOTS + FUNCTION_SLOTS + OPTIONAL_SLOTS


@dataclasses.dataclass(frozen=True)
class KernelSet:
    """The kernels of one cache: attention slots hold backend specs, the others functions."""

    prefill_ragged: object = ()
    prefill_paged: object = ()
    decode_paged: object = ()
    prefill_paged_sliding_window: object = ()
    decode_paged_sliding_window: object = ()
    tree_attn_paged_kv: object = ()
    tree_attn_ragged: object = ()
    transpose_append: object = None
    split_rotary: object = None
    copy_single_page: object = None
    compact_copy: object = None
    debug_get_kv: object = None
    merge_state: object = None
    split_rotary_append: object = None
    decode_append: object = None
    prefill_paged_mla: object = ()
    decode_paged_mla: object = ()
    transpose_append_mla: object = None
    merge_attn_output: object = None


# slot -> (generator, the config fields the generator reads besides shapes/dtype/target).
_GENERATORS = {
    "prefill_ragged": (tir_kernels.ragged_prefill, ("rope_scaling",)),
    "prefill_paged": (tir_kernels.paged_prefill, ("rope_scaling", "kv_dtype")),
    "decode_paged": (tir_kernels.paged_decode, ("rope_scaling", "kv_dtype")),
    "prefill_paged_sliding_window": (tir_kernels.paged_prefill, ("rope_scaling", "sliding_window", "kv_dtype")),
    "decode_paged_sliding_window": (tir_kernels.paged_decode, ("rope_scaling", "sliding_window", "kv_dtype")),
    "transpose_append": (tir_kernels.transpose_append, ("kv_dtype",)),
    "split_rotary": (tir_kernels.split_rotary, ("rope_theta", "rope_scale", "rope_scaling")),
    "split_rotary_append": (tir_kernels.split_rotary_append, ("rope_theta", "rope_scale", "rope_scaling", "kv_dtype")),
    "copy_single_page": (tir_kernels.copy_single_page, ("kv_dtype",)),
    "compact_copy": (tir_kernels.compact_copy, ("kv_dtype",)),
    "debug_get_kv": (tir_kernels.debug_get_kv, ("kv_dtype",)),
    "merge_state": (tir_kernels.merge_state, ()),
    "tree_attn_paged_kv": (tir_kernels.tree_mask_paged_prefill, ("kv_dtype",)),
    "tree_attn_ragged": (tir_kernels.tree_mask_ragged_prefill, ()),
}
TREE_SLOTS = ("tree_attn_paged_kv", "tree_attn_ragged")
_NEUTRAL = {"rope_theta": 10000.0, "rope_scale": 1.0, "rope_scaling": None, "sliding_window": False, "kv_dtype": ""}


def paged_slots(sliding_window: bool) -> tuple[str, str]:
    """(paged prefill slot, paged decode slot) of a cache with or without sliding windows."""
    if sliding_window:
        return "prefill_paged_sliding_window", "decode_paged_sliding_window"
    return "prefill_paged", "decode_paged"


def slots_used(sliding_window: bool) -> tuple:
    """The slots a cache builds when it is created (the tree-mask slots are deferred)."""
    return ("prefill_ragged",) + paged_slots(sliding_window) + FUNCTION_SLOTS


@dataclasses.dataclass(frozen=True)
class Deferred:
    """tvmattn's kernel for a slot, built on first use (`build()`; once per process)."""

    slot: str
    config: AttentionConfig
    num_layers: int

    def build(self):
        return build_slot(self.slot, self.config, self.num_layers)


def check_slot_names(overrides: dict) -> None:
    unknown = sorted(set(overrides) - set(SLOTS))
    if unknown:
        raise KVCacheError(f"kernels: unknown slots {unknown}; the slots are {list(SLOTS)}")


def default_kernels(config: AttentionConfig, num_layers: int, *, sliding_window: bool = False,
                    layer_windows: bool = False, overrides: dict | None = None) -> KernelSet:
    """tvmattn's kernels for `config` (its target is the cache's device) in every slot the cache
    runs, except those given in `overrides` (slot -> spec or function), which are used as given.
    layer_windows: the cache has MHA_SLIDING layers (decode_paged_sliding_window is built too).

    Each kernel is compiled once per process: a second cache whose kernels have the same
    configuration builds nothing.
    """
    overrides = dict(overrides or {})
    check_slot_names(overrides)
    used = slots_used(sliding_window) + (("decode_paged_sliding_window",) if layer_windows else ())
    built = {slot: build_slot(slot, config, num_layers) for slot in used if slot not in overrides}
    if not sliding_window:
        built.update({slot: Deferred(slot, config, num_layers) for slot in TREE_SLOTS if slot not in overrides})
    if "split_rotary_append" not in overrides and not {"split_rotary", "transpose_append"} & set(overrides):
        built["split_rotary_append"] = build_slot("split_rotary_append", config, num_layers)
        if not sliding_window and not {"decode_append", "decode_paged"} & set(overrides):
            built["decode_append"] = decode_append_kernel(config)
    return KernelSet(**built, **overrides)


def build_slot(slot: str, config: AttentionConfig, num_layers: int):
    """tvmattn's kernel for one slot: a function, or ["tirx", function] for attention slots.
    A decode slot whose config the decode table (tir_kernels/decode_table.json) serves with more
    than one schedule gets a `DecodeByShape` over those variants (each compiled once)."""
    generator, reads = _GENERATORS[slot]
    neutral = {field: value for field, value in _NEUTRAL.items() if field not in reads}
    if "sliding_window" in reads:
        neutral["sliding_window"] = True
    extra = (num_layers,) if slot == "debug_get_kv" else ()
    config = config.replace(**neutral)
    if generator is tir_kernels.paged_decode:
        return ["tirx", decode_kernel(config)]
    func = _build(generator, config, extra)
    return ["tirx", func] if slot in ATTENTION_SLOTS else func


@functools.lru_cache(maxsize=None)
def decode_kernel(config: AttentionConfig):
    """The paged decode of config: one compiled function, or a `DecodeByShape` over the table's
    variants for config (schedules.decode_variants: a schedule and its inline-RoPE build's)."""
    from tir_kernels.schedules import decode_variants

    if config.kv_fp8:  # FP8 pages: paged_decode's own choice (the table measured fp16/bf16 pages)
        return _build(tir_kernels.paged_decode, config, ())
    return _by_shape(tir_kernels.paged_decode, config, decode_variants(config), lambda sched, rope: (sched, rope))


@functools.lru_cache(maxsize=None)
def decode_append_kernel(config: AttentionConfig):
    """The decode with the append of config beside `decode_kernel(config)`: one compiled function,
    or a `DecodeByShape` over the same table variants; None where it is not built (a variant on
    the CUDA-core kernel, or `tir_kernels.decode_append_problem`'s reasons)."""
    from tir_kernels.schedules import decode_variants

    config = config.replace(sliding_window=False)
    if tir_kernels.decode_append_problem(config) is not None:
        return None
    variants = decode_variants(config)
    if any(tir_kernels.decode_append_problem(config, sched) for sched, _, shapes in variants if shapes):
        return None
    return _by_shape(tir_kernels.paged_decode_append, config, variants, lambda sched, rope: (sched,))


def _by_shape(generator, config: AttentionConfig, variants: list, extra):
    """generator's kernel of config for the decode table's `variants` (schedules.decode_variants):
    the generator's own choice where the table has no entry, else each variant's build
    (generator(config, *extra(schedule, rope_schedule))), one function or a `DecodeByShape`."""
    if len(variants) == 1 and not variants[0][2]:  # no table entry: the generator's own choice
        return _build(generator, config, ())
    built = [(_build(generator, config, extra(sched, rope)), shapes) for sched, rope, shapes in variants]
    return built[0][0] if len(built) == 1 else DecodeByShape(built, config.page_size)


class DecodeByShape:
    """A paged decode function over several compiled variants of one config, each serving the
    table's (batch, context) shapes it is the fastest at: a call runs the variant of the
    nearest shape (log2 distance in batch and in mean context, the context estimated from the
    page-index count: page_indices.shape[0] * page_size / batch). Choices are memoized per
    (batch, page count). Same arguments as the decode kernel (the contract's)."""

    MEMO_LIMIT = 4096

    def __init__(self, variants, page_size: int):
        self.variants = [func for func, _ in variants]
        self.entries = [(b, n, i) for i, (_, shapes) in enumerate(variants) for b, n in shapes]
        self.page_size = page_size
        self._memo: dict = {}

    def pick(self, batch: int, num_pages: int) -> int:
        """Index of the variant for `batch` requests holding `num_pages` pages in all."""
        key = (batch, num_pages)
        index = self._memo.get(key)
        if index is None:
            from tir_kernels.schedules import nearest_entry

            index = nearest_entry(self.entries, batch, max(1, num_pages * self.page_size // max(batch, 1)))
            if len(self._memo) >= self.MEMO_LIMIT:
                self._memo.clear()
            self._memo[key] = index
        return index

    def variant(self, batch: int, num_pages: int):
        """The variant function for `batch` requests holding `num_pages` pages in all (`pick`)."""
        return self.variants[self.pick(batch, num_pages)]

    def __call__(self, q, pages, page_indptr, page_indices, *args):
        return self.variant(int(q.shape[0]), int(page_indices.shape[0]))(q, pages, page_indptr, page_indices, *args)


@functools.lru_cache(maxsize=None)
def _build(generator, config: AttentionConfig, extra: tuple):
    return tir_kernels.build(generator(config, *extra), config)
