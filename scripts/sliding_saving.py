"""The page saving of Gemma 3 270M's sliding layers at long contexts, from the cache's own report.

Creates a PagedKVCache with Gemma 3 270M's attention layout (18 layers, every sixth global,
the others MHA_SLIDING with window 512; 4 query heads, one KV head of 256; fp16 pages of 16
tokens), sized for the longest context, and appends one sequence's tokens in prefill chunks
through the cache's sequence table: the page bookkeeping that begin_forward and end_forward do
(no attention runs: the pages held do not depend on the values). At each context it prints
a Markdown row of `memory_report()`: pages one sliding layer holds, pages one global layer
holds (what full attention holds per layer), bytes held over all layers against full
attention, and the pools allocated against pools all of full size.

    PYTHONPATH=. python scripts/sliding_saving.py [--contexts 2048 8192 32768] [--window 512] [--page-size 16]
"""

from __future__ import annotations

import argparse

from tvmattn import PagedKVCache

MIB = 1 << 20


def gemma3_cache(context: int, window: int, page_size: int, chunk: int) -> PagedKVCache:
    kinds = (["mha_sliding"] * 5 + ["mha"]) * 3
    return PagedKVCache(num_layers=18, num_qo_heads=4, num_kv_heads=1, qk_head_dim=256, dtype="float16",
                        page_size=page_size, max_num_sequences=1, max_total_seq_len=context,
                        prefill_chunk_size=chunk, rope_mode="normal", attn_kinds=kinds,
                        layer_sliding_window_size=window)


def rows(contexts: list, window: int, page_size: int, chunk: int = 2048) -> list[str]:
    """The table's rows, one per context (in increasing order)."""
    cache = gemma3_cache(max(contexts), window, page_size, chunk)
    cache.add_sequence(0)
    table = cache._table  # (the bookkeeping of begin_forward / end_forward, without the layers' launches)
    seq, length, out = table.get(0), 0, []
    for context in sorted(contexts):
        while length < context:
            n = min(chunk, context - length)
            table.reserve_plain([seq], [n])
            table.commit_step()
            length += n
        r = cache.memory_report()
        out.append(f"| {context:,} | {r['sliding_pages']} | {r['pages']} | {r['held_bytes'] / MIB:.1f} MiB | "
                   f"{r['full_bytes'] / MIB:.1f} MiB | {r['held_bytes'] / r['full_bytes']:.3f} |")
    r = cache.memory_report()
    out.append(f"\npools allocated for {max(contexts):,} tokens: {r['pool_bytes'] / MIB:.1f} MiB "
               f"(full attention: {r['full_pool_bytes'] / MIB:.1f} MiB)")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192, 32768])
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--page-size", type=int, default=16)
    args = parser.parse_args()
    print("| context | sliding pages per layer | full pages per layer | bytes held (all layers) | full attention "
          "| held / full |")
    print("|--------:|------------------------:|---------------------:|------------------------:|---------------:"
          "|------------:|")
    print("\n".join(rows(args.contexts, args.window, args.page_size)))


if __name__ == "__main__":
    main()
