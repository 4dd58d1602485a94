"""The model runner of the serving engine: one loaded library bundle (`tvmattn.generate.Generator`'s
loading: VM, weights, tokenizer), one paged KV cache of a chosen size, and the forward steps the
engine schedules. Only the engine's step thread calls it (the cache is single-threaded).

A step appends tokens to several cache sequences at once:

- `decode(seq_ids, tokens)`: one token per sequence (`batch_decode`, or `decode` for one; a CUDA
  graph replay per batch bucket where the Generator uses them);
- `mixed(seq_ids, chunks)`: any token counts per sequence (decode tokens of running requests
  beside prompt chunks of others) in one `batch_prefill` call, which returns the logits of each
  chunk's last token;
- `verify(seq_ids, trees)`: token trees of speculative decoding (`batch_verify`): the logits of
  every node; `commit(seq_ids, leaves)` keeps each accepted path.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import tvm
from tvm.runtime import ShapeTuple

from ..generate import GenerateError, Generator, _check_finite

# the per-sequence functions of the KV state, under the prefix of the cache kind
_KV_FUNCTIONS = ("kv_state_add_sequence", "kv_state_remove_sequence", "kv_state_fork_sequence", "kv_state_popn",
                 "kv_state_begin_forward", "kv_state_end_forward",
                 "attention_kv_cache_commit_accepted_token_tree_nodes",
                 "attention_kv_cache_get_num_available_pages")


def _parse_memory(value: str | float | int) -> float:
    """'4GiB', '512MB', '2e9', 0.5 -> bytes (> 1) or a fraction (0 < f <= 1)."""
    if isinstance(value, (int, float)):
        return float(value)
    text = value.strip().lower().replace(" ", "")
    units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "kb": 1e3, "mb": 1e6, "gb": 1e9, "k": 2**10, "m": 2**20,
             "g": 2**30, "b": 1}
    for unit, scale in units.items():
        if text.endswith(unit):
            return float(text[: -len(unit)]) * scale
    return float(text)


def _free_memory(device) -> int:
    """Free memory of the device in bytes (CPU: MemAvailable of /proc/meminfo)."""
    if device.dlpack_device_type() == tvm.cpu().dlpack_device_type():
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    available = getattr(device, "available_global_memory", None)
    if available:
        return int(available)
    return int(device.total_global_memory)


class ModelRunner:
    """A library bundle with a KV cache for `total_tokens` tokens over at most `max_sequences`
    cache sequences (running requests plus the prefix cache's nodes).

    kv_cache_memory: bytes (or a string such as '2GiB') or a fraction of the free device memory
    for the pages; max_total_tokens: the pool size in tokens. One of the two, or neither (then
    the library's max batch size x context window)."""

    def __init__(self, lib_path: str | Path, *, max_total_tokens: int | None = None,
                 kv_cache_memory: str | float | None = None, max_sequences: int | None = None,
                 cuda_graph: bool = True, generator: Generator | None = None):
        self.generator = generator if generator is not None else Generator(lib_path, cuda_graph=cuda_graph)
        g = self.generator
        self.settings = g.settings
        self.page_size = g.settings["page_size"]
        self.context_window = g.settings["context_window"]
        self.max_batch_size = g.settings["max_batch_size"]
        self.prefill_chunk = g.settings["prefill_chunk"]
        self.vocab_size = g.metadata["model_config"]["vocab_size"]
        self.tokenizer = g.tokenizer
        self.stop_ids = frozenset(g.stop_ids)
        self.has_verify = "batch_verify" in g.metadata.get("functions", [])
        if max_total_tokens is not None and kv_cache_memory is not None:
            raise GenerateError("give --max-total-tokens or --kv-cache-memory, not both")
        self.total_tokens = self._pool_tokens(max_total_tokens, kv_cache_memory)
        self.max_sequences = max_sequences or 2 * self.max_batch_size + 64
        kind = g.metadata["kv_cache"]["kind"]
        prefix = "tvmattn." if kind == "tvmattn" else "vm.builtin."
        self.kv = {name: tvm.get_global_func(prefix + name) for name in _KV_FUNCTIONS}
        self.cache = g.vm["create_paged_kv_cache"](
            ShapeTuple([self.max_sequences]), ShapeTuple([self.total_tokens]), ShapeTuple([self.prefill_chunk]),
            ShapeTuple([self.page_size]), ShapeTuple([0]))
        g.cache, g._capacity, g._graphs, g._graph_ids = self.cache, self.total_tokens, None, {}
        self.num_pages = self.available_pages()

    def _pool_tokens(self, max_total_tokens: int | None, kv_cache_memory) -> int:
        page = self.page_size
        if max_total_tokens is not None:
            if isinstance(max_total_tokens, bool) or not isinstance(max_total_tokens, int) or max_total_tokens < page:
                raise GenerateError(f"--max-total-tokens must be an integer >= the page size {page}, "
                                    f"got {max_total_tokens!r}")
            return -(-max_total_tokens // page) * page
        if kv_cache_memory is None:
            return self.max_batch_size * self.context_window
        try:
            amount = _parse_memory(kv_cache_memory)
        except ValueError:
            raise GenerateError(f"--kv-cache-memory must be bytes ('2GiB', '512MB', 1e9) or a fraction in (0, 1], "
                                f"got {kv_cache_memory!r}") from None
        if not amount > 0:
            raise GenerateError(f"--kv-cache-memory must be positive, got {kv_cache_memory!r}")
        budget = amount * _free_memory(self.generator.device) if amount <= 1 else amount
        tokens = int(budget // self.bytes_per_token()) // page * page
        if tokens < page:
            raise GenerateError(f"--kv-cache-memory {kv_cache_memory!r} holds less than one page "
                                f"({self.bytes_per_token() * page} bytes)")
        return tokens

    def bytes_per_token(self) -> int:
        """K and V bytes of one token over every layer."""
        config = self.generator.metadata["model_config"]
        spec = self.generator.metadata["kv_cache"]
        layers = config.get("num_hidden_layers") or spec.get("num_layers")
        kv_heads = config.get("num_key_value_heads") or config.get("num_attention_heads")
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        dtype = spec.get("dtype") or self.generator.metadata.get("dtype", "float16")
        size = np.dtype("float32").itemsize if "32" in str(dtype) else 2
        return int(2 * layers * kv_heads * head_dim * size)

    # ------------------------------------------------------------------ sequences
    def add(self, seq_id: int) -> None:
        self.kv["kv_state_add_sequence"](self.cache, seq_id)

    def remove(self, seq_id: int) -> None:
        self.kv["kv_state_remove_sequence"](self.cache, seq_id)

    def fork(self, parent: int, child: int, position: int) -> None:
        self.kv["kv_state_fork_sequence"](self.cache, parent, child, position)

    def available_pages(self) -> int:
        return int(self.kv["attention_kv_cache_get_num_available_pages"](self.cache))

    # ------------------------------------------------------------------ steps
    def decode(self, seq_ids: list[int], tokens: list[int]) -> np.ndarray:
        """One token per sequence -> logits [len(seq_ids), vocab] f32."""
        logits = self.generator.decode_step(seq_ids, tokens, single=True)
        _check_finite(logits, 1, seq_ids)
        return logits

    def mixed(self, seq_ids: list[int], chunks: list[list[int]]) -> np.ndarray:
        """chunks[i] (>= 1 token) appended to seq_ids[i] in one step -> logits [len(seq_ids), vocab]
        f32 of each chunk's last token."""
        g = self.generator
        if all(len(c) == 1 for c in chunks):
            return self.decode(seq_ids, [c[0] for c in chunks])
        flat = [t for c in chunks for t in c]
        embeds = g._embed(flat)[None]
        ends = np.cumsum([len(c) for c in chunks]).astype(np.int32) - 1
        positions = tvm.runtime.tensor(ends, device=g.device)
        logits = g._forward("batch_prefill", seq_ids, [len(c) for c in chunks], embeds, positions)[0]
        _check_finite(logits, 0, seq_ids)
        return logits

    def verify(self, seq_ids: list[int], tokens: list[list[int]], parents: list[list[int]]) -> list[np.ndarray]:
        """Token trees (tokens[i] with parents[i], node 0 the root) -> per sequence the logits
        [len(tree), vocab] after each node. The trees stay uncommitted (see commit)."""
        g = self.generator
        flat = [t for tree in tokens for t in tree]
        logits = g._forward("batch_verify", seq_ids, [len(t) for t in tokens], g._embed(flat)[None],
                            parents=[p for tree in parents for p in tree])[0]
        _check_finite(logits, 1, seq_ids)
        ends = np.cumsum([len(t) for t in tokens])
        return [logits[end - len(t):end] for end, t in zip(ends, tokens)]

    def commit(self, seq_ids: list[int], leaves: list[int]) -> None:
        self.kv["attention_kv_cache_commit_accepted_token_tree_nodes"](self.cache, ShapeTuple(seq_ids),
                                                                       ShapeTuple(leaves))
