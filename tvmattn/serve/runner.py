"""The model runner of the serving engine: a `tvmattn.session.ModelSession` (one loaded library
bundle) with one paged KV cache of a chosen size, and the forward steps the engine schedules;
and `DraftModel`, a second session that drafts token trees for speculative decoding. Only the
engine's step thread calls them (a cache is single-threaded).

A step appends tokens to several cache sequences at once:

- `mixed(seq_ids, chunks)`: any token counts per sequence (decode tokens of running requests
  beside prompt chunks of others) in one `batch_prefill` call, which returns the logits of each
  chunk's last token; one token per sequence is a decode step (`batch_decode`, or `decode` for
  one; a CUDA graph replay per batch bucket where the session uses them);
- `verify(seq_ids, trees)`: token trees of speculative decoding (`batch_verify`): the logits of
  every node; `commit(seq_ids, leaves)` keeps each accepted path.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import tvm

from tir_kernels.support import numpy_dtype

from ..session import GenerateError, ModelSession
from ..speculative import DraftTree, common_prefix, draft_model_tree


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
    the library's max batch size x context window). session: an already loaded library (its
    current cache is replaced by this runner's); else lib_path is loaded."""

    def __init__(self, lib_path: str | Path | None = None, *, max_total_tokens: int | None = None,
                 kv_cache_memory: str | float | None = None, max_sequences: int | None = None,
                 cuda_graph: bool = True, session: ModelSession | None = None):
        if (lib_path is None) == (session is None):
            raise ValueError("give a library path or a loaded session (one of the two)")
        self.session = s = session if session is not None else ModelSession(lib_path, cuda_graph=cuda_graph)
        self.settings = s.settings
        self.page_size = s.settings["page_size"]
        self.context_window = s.settings["context_window"]
        self.max_batch_size = s.settings["max_batch_size"]
        self.prefill_chunk = s.settings["prefill_chunk"]
        self.vocab_size = s.vocab_size
        self.tokenizer = s.tokenizer
        self.stop_ids = s.stop_ids
        self.has_verify = s.has_verify
        if max_total_tokens is not None and kv_cache_memory is not None:
            raise GenerateError("give --max-total-tokens or --kv-cache-memory, not both")
        self.total_tokens = self._pool_tokens(max_total_tokens, kv_cache_memory)
        self.max_sequences = max_sequences or 2 * self.max_batch_size + 64
        s.create_cache(self.max_sequences, self.total_tokens)
        self.num_pages = self.available_pages()

    @property
    def cache(self):
        return self.session.cache

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
        budget = amount * _free_memory(self.session.device) if amount <= 1 else amount
        tokens = int(budget // self.bytes_per_token()) // page * page
        if tokens < page:
            raise GenerateError(f"--kv-cache-memory {kv_cache_memory!r} holds less than one page "
                                f"({self.bytes_per_token() * page} bytes)")
        return tokens

    def bytes_per_token(self) -> int:
        """K and V bytes of one token over every layer."""
        config = self.session.metadata["model_config"]
        spec = self.session.metadata["kv_cache"]
        layers = config.get("num_hidden_layers") or spec.get("num_layers")
        kv_heads = config.get("num_key_value_heads") or config.get("num_attention_heads")
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        # the pages' element type: an FP8 library (kv_dtype) stores one byte an element
        dtype = spec.get("kv_dtype") or spec.get("dtype") or self.session.metadata.get("dtype", "float16")
        size = numpy_dtype(dtype).itemsize
        return int(2 * layers * kv_heads * head_dim * size)

    # ------------------------------------------------------------------ sequences
    def add(self, seq_id: int) -> None:
        self.session.add_sequence(seq_id)

    def remove(self, seq_id: int) -> None:
        self.session.remove_sequence(seq_id)

    def fork(self, parent: int, child: int, position: int) -> None:
        self.session.fork_sequence(parent, child, position)

    def popn(self, seq_id: int, n: int) -> None:
        """Drop the sequence's last n tokens (ValueError where the cache refuses: a sliding
        window that released the pages they would expose)."""
        self.session.popn(seq_id, n)

    def available_pages(self) -> int:
        return self.session.available_pages()

    # ------------------------------------------------------------------ steps
    def mixed(self, seq_ids: list[int], chunks: list[list[int]], on_host: bool = True):
        """chunks[i] (>= 1 token) appended to seq_ids[i] in one step -> logits [len(seq_ids), vocab]
        f32 of each chunk's last token; on_host False: left on the device (a tensor whose rows,
        flattened over its leading axes, are those rows; no copy), for the device sampler."""
        return self.session.mixed(seq_ids, chunks, on_host)

    def decode_fed(self, seq_ids: list[int], tokens):
        """A decode step of one token per sequence whose ids are a device tensor (the previous
        step's `sample` output, not read by the host) -> its logits, left on the device."""
        return self.session.decode_step(seq_ids, tokens, on_host=False)

    def graph_sample_params(self, rows: int):
        """Where a decode step of `rows` sequences that samples inside its CUDA graph reads its
        sampling parameters (DeviceSampler.prepare's params_at), or None where steps do not."""
        return self.session.graph_sample_params(rows)

    def decode_fed_sampled(self, seq_ids: list[int], tokens):
        """decode_fed whose CUDA graph also samples (graph_sample_params) -> (logits, ids), both
        left on the device."""
        return self.session.decode_sampled(seq_ids, tokens)

    def verify(self, seq_ids: list[int], tokens: list[list[int]], parents: list[list[int]], on_host: bool = True):
        """Token trees (tokens[i] with parents[i], node 0 the root) -> per sequence the logits
        [len(tree), vocab] after each node (on_host False: one device tensor of every node's row,
        the trees in order). The trees stay uncommitted (see commit)."""
        return self.session.verify(seq_ids, tokens, parents, on_host)

    def commit(self, seq_ids: list[int], leaves: list[int]) -> None:
        self.session.commit(seq_ids, leaves)


class DraftModel:
    """A drafting library (tvmattn/speculative.py) with a KV cache of its own, a sequence per
    request (keyed by the engine's request id): greedy drafts, the top `width` tokens at the
    first draft position. Before each draft its sequence is rolled back (popn) to the longest
    prefix it shares with the request's tokens and fed the rest.

    session: the draft library (its cache is replaced: `tokens` tokens over `max_sequences`
    sequences); scale: its weights' share of the drafted-for model's (the back-off's prior for
    what a draft token costs)."""

    def __init__(self, session: ModelSession, width: int, tokens: int, max_sequences: int, scale: float = 1.0):
        self.session, self.width, self.scale = session, width, scale
        session.create_cache(max_sequences, tokens)
        self.cached: dict[int, list[int]] = {}  # request id -> the tokens its sequence holds

    def prefill(self, keys: list[int], prompts: list[list[int]]) -> None:
        """Feed whole prompts to new sequences (the drafts then need one token's feed)."""
        for key in keys:
            self.session.add_sequence(key)
        self.session.prefill(keys, prompts)
        for key, prompt in zip(keys, prompts):
            self.cached[key] = list(prompt)

    def release(self, key: int) -> None:
        """Remove a request's sequence (when the request ends)."""
        if self.cached.pop(key, None) is not None:
            self.session.remove_sequence(key)

    def draft(self, keys: list[int], contexts: list[list[int]], budgets: list[int]) -> list[DraftTree]:
        """One tree per request (contexts end with the pending token) of at most budgets[i] drafts."""
        s = self.session
        trees = [DraftTree.root(c[-1]) for c in contexts]
        want = [i for i, b in enumerate(budgets) if b >= 1]
        if not want:
            return trees
        feeds = []
        for i in want:  # roll the draft sequence back to what it shares with the request
            key, context = keys[i], contexts[i]
            if key not in self.cached:
                s.add_sequence(key)
                self.cached[key] = []
            have = self.cached[key]
            keep = min(common_prefix(have, context), len(context) - 1)  # the last token is fed for its logits
            if keep < len(have):
                try:
                    s.popn(key, len(have) - keep)
                except ValueError:  # its sliding-window layers released what `keep` needs: start over
                    s.remove_sequence(key)
                    s.add_sequence(key)
                    keep = 0
                del have[keep:]
            feeds.append(context[keep:])
            have.extend(context[keep:])
        first = s.prefill([keys[i] for i in want], feeds)
        widths = {i: min(self.width, budgets[i]) for i in want}
        chains: dict[int, list[int]] = {i: [] for i in want}
        current = {i: int(np.argmax(first[k])) for k, i in enumerate(want)}
        while True:  # greedy chain below the best first token
            going = [i for i in want if len(chains[i]) < budgets[i] - widths[i]]
            if not going:
                break
            embeds = s.embed([current[i] for i in going])[:, None, :]
            rows = s.forward("decode" if len(going) == 1 else "batch_decode", [keys[i] for i in going],
                             [1] * len(going), embeds)[:, 0]
            for k, i in enumerate(going):
                self.cached[keys[i]].append(current[i])
                current[i] = int(np.argmax(rows[k]))
                chains[i].append(current[i])
        for k, i in enumerate(want):
            trees[i] = draft_model_tree(contexts[i][-1], first[k], chains[i], widths[i])
        return trees
