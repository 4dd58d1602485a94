"""A loaded model library and its forward steps: the lowest layer of generation and serving.

`ModelSession(lib_path)` checks and loads a bundle made by tvmattn.build (OUT.so into the Relax
VM, OUT.params.npz onto the device, the tokenizer), creates its paged KV cache
(`create_cache`) and runs the library's functions over cache sequences:

- `prefill(seq_ids, prompts)`: whole prompts, the logits of each one's last token;
- `decode_step(seq_ids, tokens)`: one token per sequence (`decode` for one sequence, else
  `batch_decode`; on CUDA a replayed CUDA graph per batch bucket, tvmattn.runtime.graphs);
  `decode_sampled`: the same graph, whose last kernel is the library's `sample` (the step's
  token choice inside the graph, its parameters uploaded to `graph_sample_params` first);
- `forward(function, ...)`: any step function between `begin_forward` and `end_forward`
  (`batch_prefill` of mixed chunks, `batch_verify` of draft trees); `commit` keeps the
  accepted paths of a verify step;
- the sequence operations of the cache (add, remove, fork, popn, free pages).

It holds no loop: the serving engine (tvmattn/serve/engine.py) schedules these steps, and
`tvmattn.generate.Generator` drives that engine. The bundle's files are read and checked by
tvmattn/bundle.py; every problem is a GenerateError naming it.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import tvm
import tvm_ffi
from tvm import relax
from tvm.runtime import ShapeTuple

from tir_kernels import support

from .runtime import ffi as _ffi  # noqa: F401  - registers tvmattn.* before the library is loaded
from .bundle import BundleError, load_params, load_tokenizer, open_bundle
from .device_sampling import FEED_FUNCTION, DeviceSampler, has_device_sampling
from .runtime.upload import make_uploader
from .speculative import VERIFY_PRIOR_CPU, VERIFY_PRIOR_GPU, StepCosts

# Prompt tokens per prefill call on the CPU: a 512-token prompt in two calls holds half the
# activations at the peak at the cost of a second pass over the weights; the GEMMs reuse each
# dequantized weight tile over every token of a call, so calls of 256 tokens keep that reuse
CPU_PREFILL_CHUNK = 256

# the per-sequence functions of the KV state, under the prefix of the cache kind
_KV_FUNCTIONS = ("kv_state_add_sequence", "kv_state_remove_sequence", "kv_state_fork_sequence", "kv_state_popn",
                 "kv_state_begin_forward", "kv_state_end_forward",
                 "attention_kv_cache_commit_accepted_token_tree_nodes",
                 "attention_kv_cache_get_num_available_pages")


class GenerateError(ValueError):
    """A missing or inconsistent library bundle, or a bad generation argument."""


@contextlib.contextmanager
def no_cyclic_gc():
    """Python's cyclic garbage collector off inside (restored after): a decode step allocates a
    few hundred short-lived objects (TVM handles, shapes), which trigger generation-0
    collections that walk every tracked object, a visible share of a CPU decode loop under
    `perf`. Reference counting still frees everything acyclic."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _default_cpu_threads() -> None:
    """TVM's CPU thread pool, unless TVM_NUM_THREADS says otherwise, gets a thread per CPU this
    process may run on: TVM's own default is half the CPUs (it assumes hyper-threads), one thread
    on a 2-CPU machine, which then decodes at about half the speed. Read when the pool starts,
    before the first kernel runs."""
    if "TVM_NUM_THREADS" not in os.environ and hasattr(os, "sched_getaffinity"):
        os.environ["TVM_NUM_THREADS"] = str(len(os.sched_getaffinity(0)))


def load_library(path: Path, device: tvm.runtime.Device) -> tuple[relax.VirtualMachine, dict[str, Any]]:
    """(the Relax VM over OUT.so, the metadata the library holds); raises GenerateError."""
    # TVM reports a library it cannot use with several error types (InternalError, a
    # RuntimeError; AttributeError for a missing function): each becomes one GenerateError.
    try:
        module = tvm.runtime.load_module(str(path))
    except (RuntimeError, OSError, ValueError) as err:
        raise GenerateError(f"{path} cannot be loaded ({str(err).strip().splitlines()[-1]}); recompile") from None
    try:
        vm = relax.VirtualMachine(module, device)
        metadata = json.loads(str(vm["_metadata"]()))
    except (RuntimeError, AttributeError, ValueError) as err:
        raise GenerateError(f"{path}: not a tvmattn model library ({str(err).strip().splitlines()[-1]}); "
                            f"recompile") from None
    return vm, metadata


def library_decode_step(vm: relax.VirtualMachine, ids, cache, params, hidden: int, sample_params=None):
    """One decode step of a model library from token ids [b] int32 on the device -> logits
    [b, 1, vocab] f32: what a CUDA graph captures. b = 1 runs `embed` then the static `decode`
    (whose matmuls get dlight's single-row GEMV, several times faster at one row than the
    symbolic-batch kernels); larger b runs `decode_step` (storage allocated once per VM).
    sample_params (float32 [b, 4], tvmattn.device_sampling's layout): the step ends with the
    library's `sample` over its logits -> (logits, ids [b] int32)."""
    if ids.shape[0] == 1:
        embeds = vm["embed"](ids, params)._create_view((1, 1, hidden))
        logits, _ = vm["decode"](embeds, cache, params)
    else:
        logits, _ = vm["decode_step"](ids, cache, params)
    if sample_params is None:
        return logits
    return logits, vm["sample"](logits._create_view((int(ids.shape[0]), int(logits.shape[-1]))), sample_params)


class ModelSession:
    """A loaded library bundle: VM, weights, tokenizer and (after `create_cache`) one KV cache.

    Before loading anything, OUT.runtime.json is checked field by field, and OUT.so and
    OUT.params.npz against the size and sha256 it recorded ("files"); bundles compiled before
    that record existed still load, without the checksum (their library's ELF headers and their
    parameters are still checked). Any broken file is a GenerateError naming it and the problem.
    """

    def __init__(self, lib_path: str | Path, cuda_graph: bool = True):
        """cuda_graph: on CUDA, replay decode steps as CUDA graphs (one per batch bucket,
        tvmattn.runtime.graphs) where the library exports `decode_step` and runs tvmattn's
        cache with its TIR kernels; otherwise (or False) every step runs eagerly."""
        lib_path = Path(lib_path)
        self.cuda_graph = cuda_graph
        try:
            bundle = open_bundle(lib_path)
            self.runtime, self.metadata, self.settings = bundle.runtime, bundle.metadata, bundle.settings
            target = self.metadata["build_options"]["target"]
            self.device = tvm.cuda(0) if target.startswith("cuda") else tvm.cpu()
            if not self.device.exist:
                raise GenerateError(f"--lib {str(lib_path)!r} was built for {target}, and no such device is present")
            params = load_params(bundle.params_file, self.metadata["params"])
            _default_cpu_threads()
            self.vm, library_metadata = load_library(lib_path, self.device)
            if library_metadata != self.metadata:
                raise GenerateError(f"{lib_path} and {bundle.runtime_file} come from different builds (their "
                                    f"metadata differ); recompile")
            self.tokenizer = load_tokenizer(bundle)
        except BundleError as err:
            raise GenerateError(str(err)) from None
        # each host array is dropped once copied, so the weights are not held twice at the peak
        params.reverse()
        tensors = []
        while params:
            tensors.append(tvm.runtime.tensor(params.pop(), device=self.device))
        # one FFI array, converted once: a Python list is converted on every call that passes it
        # (two calls a decode step, hundreds of tensors for a library kept quantized)
        self.params = tvm_ffi.convert(tensors)
        self.stop_ids = frozenset(self.runtime.get("stop_token_ids") or [])
        kind = self.metadata["kv_cache"]["kind"]
        prefix = "tvmattn." if kind == "tvmattn" else "vm.builtin."
        self._kv = {name: tvm.get_global_func(prefix + name) for name in _KV_FUNCTIONS}
        self.lib_path = lib_path
        self.vocab_size = self.metadata["model_config"]["vocab_size"]
        self.hidden_size = self.metadata["model_config"]["hidden_size"]
        # tokens per prefill call: the library's chunk, on the CPU at most CPU_PREFILL_CHUNK
        self.prefill_chunk = self.settings["prefill_chunk"]
        on_cpu = self.on_cpu = self.device.dlpack_device_type() == tvm.cpu().dlpack_device_type()
        if on_cpu:
            self.prefill_chunk = min(self.prefill_chunk, CPU_PREFILL_CHUNK)
        self._functions: dict[str, Any] = {}  # the VM's functions, looked up once (function)
        # CPU: the decode step's token ids, a tensor per batch size written through a numpy view
        # (writing into it costs far less than a new tensor from numpy every step)
        self._cpu_ids: dict[int, tuple[Any, np.ndarray]] | None = {} if on_cpu else None
        # CUDA: the token ids of a step go up by a stream-ordered copy from pinned memory
        # (tvmattn.runtime.upload), into a tensor per batch size: the host does not wait for the
        # device before launching the step
        self._ids_uploader = None if on_cpu else make_uploader(self.device)
        self._device_ids: dict[int, Any] = {}
        self.cache = None
        self.cache_tokens = 0  # tokens the current cache holds
        # FP8 KV libraries (compile --kv-cache-dtype): scales [layers, 2, kv_heads] given to each
        # cache this session creates (None: the cache's default, 1.0; tvmattn.calibrate_kv_scales)
        self.kv_scales = None
        self.graphs = None  # DecodeGraphs of the current cache (see _graph_decode)
        self._graph_ids: dict[int, Any] = {}  # bucket -> its token-id input buffer on the device
        # bucket -> the sampling parameters [bucket, 4] f32 its graph's `sample` reads (samples_in_graph)
        self._graph_params: dict[int, Any] = {}
        # what plain and speculative steps cost here, measured as they run: the engine's
        # speculative back-off weighs drafts against it (tvmattn/speculative.py)
        self.step_costs = StepCosts(VERIFY_PRIOR_CPU if on_cpu else VERIFY_PRIOR_GPU)
        self._device_sampler: DeviceSampler | None | bool = False  # False: not looked at yet

    def auto_sampler(self) -> DeviceSampler | None:
        """The sampler of sampling "auto": the device's kernels on an accelerator; None on the
        CPU, where the logits already are in host memory and numpy chooses a greedy token
        faster than the kernel launch (the same tokens either way: tvmattn.sampling)."""
        return None if self.on_cpu else self.device_sampler()

    def device_sampler(self) -> DeviceSampler | None:
        """The library's sampling kernels (tvmattn.device_sampling), made once; None when it
        exports none, or its `sample` predates the NaN flag (compiled before it: recompile)."""
        if self._device_sampler is False:
            sampler = None
            if has_device_sampling(self.metadata):
                sampler = DeviceSampler(self.vm, self.device)
                if not sampler.flags_non_finite:
                    sampler = None
            self._device_sampler = sampler
        return self._device_sampler

    @property
    def weight_bytes(self) -> int:
        """Bytes of the library's parameters (what a decode step reads)."""
        return sum(int(np.prod(p["shape"])) * support.numpy_dtype(p["dtype"]).itemsize for p in self.metadata["params"])

    @property
    def has_verify(self) -> bool:
        """The library exports batch_verify (speculative decoding)."""
        return "batch_verify" in self.metadata.get("functions", [])

    def sibling(self) -> "ModelSession":
        """The same loaded library (VM, weights, tokenizer) with a KV cache of its own: a model
        drafting for itself. Its steps run eagerly."""
        other = copy.copy(self)
        other.cache, other.cache_tokens = None, 0
        other.graphs, other._graph_ids, other._graph_params, other.cuda_graph = None, {}, {}, False
        other._device_ids = {}
        other._device_sampler = False  # staging buffers of its own
        return other

    # ------------------------------------------------------------------ the cache
    def create_cache(self, max_sequences: int, tokens: int) -> None:
        """A new KV cache (replacing the current one) for `tokens` tokens over at most
        `max_sequences` sequences at once."""
        self.cache, self.graphs, self._graph_ids = None, None, {}  # graphs belong to the cache they captured
        self.cache = self.vm["create_paged_kv_cache"](
            ShapeTuple([max_sequences]), ShapeTuple([tokens]), ShapeTuple([self.settings["prefill_chunk"]]),
            ShapeTuple([self.settings["page_size"]]), ShapeTuple([0]))
        if self.kv_scales is not None:
            self.cache.set_kv_scales(self.kv_scales)
        self.cache_tokens = tokens

    def add_sequence(self, seq_id: int) -> None:
        self._kv["kv_state_add_sequence"](self.cache, seq_id)

    def remove_sequence(self, seq_id: int) -> None:
        self._kv["kv_state_remove_sequence"](self.cache, seq_id)

    def fork_sequence(self, parent: int, child: int, position: int) -> None:
        self._kv["kv_state_fork_sequence"](self.cache, parent, child, position)

    def popn(self, seq_id: int, n: int) -> None:
        self._kv["kv_state_popn"](self.cache, seq_id, n)

    def available_pages(self) -> int:
        return int(self._kv["attention_kv_cache_get_num_available_pages"](self.cache))

    # ------------------------------------------------------------------ steps
    @property
    def uses_cuda_graph(self) -> bool:
        """Decode steps replay CUDA graphs (see __init__'s cuda_graph)."""
        from .runtime.cache import PagedKVCache

        return (self.cuda_graph and self.device.dlpack_device_type() == tvm.cuda(0).dlpack_device_type()
                and "decode_step" in self.metadata.get("functions", ()) and isinstance(self.cache, PagedKVCache)
                and self.cache.backend == "tir" and self.cache.graph_decode_supported)

    @property
    def samples_in_graph(self) -> bool:
        """Decode steps replay CUDA graphs that end with the library's `sample` kernel (the
        library has device sampling): `decode_sampled` returns the step's choices with its logits."""
        return self.uses_cuda_graph and self.device_sampler() is not None

    def graph_sample_params(self, rows: int):
        """Where the graph of a decode step of `rows` sequences reads its sampling parameters: a
        device float32 view [rows, 4] (tvmattn.device_sampling's layout), written before the
        step by DeviceSampler.prepare(params_at=); None where steps do not sample in a graph."""
        if not self.samples_in_graph:
            return None
        from .runtime.graphs import bucket_of, buckets_for

        bucket = bucket_of(rows, buckets_for(self._graph_max_batch()))
        params = self._graph_params.get(bucket)
        if params is None:  # padding rows: greedy (all zeros)
            params = self._graph_params[bucket] = tvm.runtime.tensor(np.zeros((bucket, 4), np.float32), self.device)
        return params if rows == bucket else params._create_view((rows, 4))

    def _graph_max_batch(self) -> int:
        """The largest graph bucket: the library's max batch, or the cache's sequences where it
        holds fewer (its graph-plan buffer is sized for those)."""
        return min(self.settings["max_batch_size"], self.cache.options.max_num_sequences)

    def _captured_step(self, bucket: int):
        return library_decode_step(self.vm, self._graph_ids[bucket], self.cache, self.params, self.hidden_size,
                                   self.graph_sample_params(bucket))

    def decode_sampled(self, seq_ids: list[int], tokens):
        """One decode step replayed as a CUDA graph whose last kernel samples each row with the
        parameters uploaded to `graph_sample_params(len(seq_ids))` -> (logits [len(seq_ids),
        vocab] f32, ids [len(seq_ids)] int32), both on the device and rewritten by the next
        replay of the bucket (ids: `sample`'s, NON_FINITE for a row that is not finite);
        tokens: as decode_step's. Needs `samples_in_graph`."""
        if not self.samples_in_graph:
            raise GenerateError("decode_sampled: this session's decode steps do not sample in a CUDA graph "
                                "(samples_in_graph is False)")
        logits, sampled = self._graph_run(seq_ids, tokens)
        n = len(seq_ids)
        return (logits._create_view((n, int(logits.shape[-1]))),
                sampled if int(sampled.shape[0]) == n else sampled._create_view((n,), "int32"))

    def _graph_decode(self, seq_ids: list[int], tokens, on_host: bool = True):
        """One decode step replayed as a CUDA graph -> logits [len(seq_ids), vocab] f32 (on_host
        False: a view of the graph's output tensor, rewritten by the next replay); tokens: as
        decode_step's."""
        outputs = self._graph_run(seq_ids, tokens)
        logits = outputs[0] if isinstance(outputs, tuple) else outputs
        if not on_host:
            return logits._create_view((len(seq_ids), int(logits.shape[-1])))
        return logits.numpy()[: len(seq_ids), 0]

    def _graph_run(self, seq_ids: list[int], tokens):
        """The bucket's graph replayed on `tokens` (decode_step's) -> its outputs: logits [bucket,
        1, vocab], or (logits, sampled ids [bucket]) where samples_in_graph."""
        from .runtime.graphs import DecodeGraphs, bucket_of

        if self.graphs is None:
            self.graphs = DecodeGraphs(self.cache, self._captured_step, self._graph_max_batch())
            self.device_sampler()  # (its one-time check runs a kernel and reads it: never inside a capture)
        bucket = bucket_of(len(seq_ids), self.graphs.buckets)
        ids = self._graph_ids.get(bucket)
        if ids is None:
            ids = self._graph_ids[bucket] = tvm.runtime.empty((bucket,), "int32", device=self.device)
            self._ids_uploader.copy(np.zeros(bucket, np.int32), ids)  # padding rows: a valid id
        if isinstance(tokens, tvm.runtime.Tensor):
            self._feed(tokens, ids if bucket == len(seq_ids) else ids._create_view((len(seq_ids),), "int32"))
        else:
            host = np.zeros(bucket, np.int32)
            host[: len(tokens)] = tokens
            self._ids_uploader.copy(host, ids)
        return self.graphs.run(seq_ids)

    def function(self, name: str):
        """The library's function `name`, looked up once."""
        function = self._functions.get(name)
        if function is None:
            function = self._functions[name] = self.vm[name]
        return function

    def embed(self, tokens: list[int]) -> np.ndarray:
        """Token ids -> their embeddings [len(tokens), hidden] on the host."""
        ids = tvm.runtime.tensor(np.array(tokens, dtype=np.int32), device=self.device)
        return self.function("embed")(ids, self.params).numpy()

    @property
    def feeds_tokens(self) -> bool:
        """The library exports `feed_tokens`: decode_step takes the previous step's sampled ids
        as a device tensor."""
        return FEED_FUNCTION in self.metadata.get("functions", ())

    def _feed(self, tokens, ids) -> None:
        """ids (a device int32 tensor [n]) = tokens (the `sample` output [n]), NON_FINITE as 0."""
        if not self.feeds_tokens:
            raise GenerateError(f"{self.lib_path} has no {FEED_FUNCTION} (compiled before it): decode steps take "
                                f"host token ids only; recompile")
        if tuple(tokens.shape) != tuple(ids.shape) or str(tokens.dtype) != "int32":
            raise ValueError(f"tokens: expected an int32 tensor of shape {tuple(ids.shape)} (one id per sequence), "
                             f"got {tokens.dtype} {tuple(tokens.shape)}")
        self.function(FEED_FUNCTION)(tokens, ids)

    def decode_step(self, seq_ids: list[int], tokens, on_host: bool = True):
        """One decode step of `tokens` (one per sequence) -> logits [len(seq_ids), vocab] f32: a
        CUDA graph where it uses them; else the embedding lookup feeds the step on the device (no
        copy to the host and back), through `decode` for one sequence, `batch_decode` otherwise.
        tokens: host ids, or a device int32 tensor [len(seq_ids)] such as the previous step's
        `sample` output (its NON_FINITE rows read as id 0; `feeds_tokens`), which the host need
        not have read. on_host False: the logits stay on the device (a tensor of len(seq_ids)
        rows, see `forward`)."""
        if self.uses_cuda_graph:
            return self._graph_decode(seq_ids, tokens, on_host)
        if isinstance(tokens, tvm.runtime.Tensor):
            ids = self._batch_ids(len(seq_ids))
            self._feed(tokens, ids)
        else:
            ids = self._token_ids(tokens)
        embeds = self.function("embed")(ids, self.params)._create_view((len(seq_ids), 1, self.hidden_size))
        function = "decode" if len(seq_ids) == 1 else "batch_decode"
        logits = self.forward(function, seq_ids, [1] * len(seq_ids), embeds, on_host=on_host)
        return logits[:, 0] if on_host else logits

    def _token_ids(self, tokens: list[int]):
        """tokens as an int32 tensor [len(tokens)] on the device, the same tensor for every step
        of a batch size (on the CPU the step reads it before it returns; on CUDA the copy into it
        is queued behind the previous step's kernels, which may still read it)."""
        ids = self._batch_ids(len(tokens))
        if self._cpu_ids is None:
            self._ids_uploader.copy(np.array(tokens, dtype=np.int32), ids)
        else:
            self._cpu_ids[len(tokens)][1][:] = tokens
        return ids

    def _batch_ids(self, n: int):
        """The token-id tensor [n] of decode steps of n sequences (CPU: with its numpy alias)."""
        if self._cpu_ids is None:
            ids = self._device_ids.get(n)
            if ids is None:
                ids = self._device_ids[n] = tvm.runtime.empty((n,), "int32", device=self.device)
            return ids
        entry = self._cpu_ids.get(n)
        if entry is None:
            ids = tvm.runtime.empty((n,), "int32", device=self.device)
            entry = self._cpu_ids[n] = (ids, np.from_dlpack(ids))
        return entry[0]

    def forward(self, function: str, seq_ids: list[int], lengths: list[int], embeds, *extra,
                parents: list[int] | None = None, on_host: bool = True):
        """One step of the library's `function` appending lengths[i] tokens to seq_ids[i];
        embeds: a host array, or a tensor already on the device; parents: the token trees of
        `batch_verify`, flattened. -> the function's logits on the host; on_host False: the
        logits tensor on the device as the function returned it (its rows, flattened over the
        leading axes, are the same rows in the same order: what DeviceSampler takes)."""
        tree = () if parents is None else (ShapeTuple(parents),)
        one_each = function in ("prefill", "batch_prefill") and all(n == 1 for n in lengths)
        if one_each:
            # the cache plans a step of one token per sequence as a decode step (TVM's rule; an
            # MLA library's prefill functions would then count the new tokens twice): decode it
            function, extra, embeds = "batch_decode", (), embeds.reshape(len(seq_ids), 1, -1)
        if isinstance(embeds, np.ndarray):
            embeds = tvm.runtime.tensor(embeds, device=self.device)
        self._kv["kv_state_begin_forward"](self.cache, ShapeTuple(seq_ids), ShapeTuple(lengths), *tree)
        logits, _ = self.function(function)(embeds, *extra, self.cache, self.params)
        self._kv["kv_state_end_forward"](self.cache)
        if not on_host:
            return logits
        logits = logits.numpy()
        return logits.reshape(1, len(seq_ids), -1) if one_each else logits

    def mixed(self, seq_ids: list[int], chunks: list[list[int]], on_host: bool = True):
        """chunks[i] (>= 1 token) appended to seq_ids[i] in one `batch_prefill` step (a decode
        step when every chunk is one token) -> logits [len(seq_ids), vocab] f32 of each chunk's
        last token (on_host False: a device tensor of those rows, see `forward`)."""
        if all(len(c) == 1 for c in chunks):
            return self.decode_step(seq_ids, [c[0] for c in chunks], on_host)
        embeds = self.embed([t for c in chunks for t in c])[None]
        ends = np.cumsum([len(c) for c in chunks]).astype(np.int32) - 1
        positions = tvm.runtime.tensor(ends, device=self.device)
        logits = self.forward("batch_prefill", seq_ids, [len(c) for c in chunks], embeds, positions, on_host=on_host)
        return logits[0] if on_host else logits

    def prefill(self, seq_ids: list[int], prompts: list[list[int]]) -> np.ndarray:
        """Whole prompts appended to their sequences -> [len(prompts), vocab] logits of each
        prompt's last token: one `batch_prefill` when they fit a prefill call, else one
        sequence at a time in calls of `prefill_chunk` tokens."""
        chunk = self.prefill_chunk
        if len(prompts) > 1 and sum(len(p) for p in prompts) <= chunk:
            return self.mixed(seq_ids, prompts)
        rows = []
        for seq_id, prompt in zip(seq_ids, prompts):
            for begin in range(0, len(prompt), chunk):
                piece = prompt[begin:begin + chunk]
                logits = self.forward("prefill", [seq_id], [len(piece)], self.embed(piece)[None])
            rows.append(logits[0, 0])
        return np.stack(rows)

    def verify(self, seq_ids: list[int], tokens: list[list[int]], parents: list[list[int]], on_host: bool = True):
        """Token trees (tokens[i] with parents[i], node 0 the root) -> per sequence the logits
        [len(tree), vocab] after each node (on_host False: the device tensor of every node's
        row, the trees one after the other). The trees stay uncommitted (see commit)."""
        flat = [t for tree in tokens for t in tree]
        logits = self.forward("batch_verify", seq_ids, [len(t) for t in tokens], self.embed(flat)[None],
                              parents=[p for tree in parents for p in tree], on_host=on_host)
        if not on_host:
            return logits
        logits = logits[0]
        ends = np.cumsum([len(t) for t in tokens])
        return [logits[end - len(t):end] for end, t in zip(ends, tokens)]

    def commit(self, seq_ids: list[int], leaves: list[int]) -> None:
        """Keep each verified tree's path from its root to leaves[i]; drop its other nodes."""
        self._kv["attention_kv_cache_commit_accepted_token_tree_nodes"](self.cache, ShapeTuple(seq_ids),
                                                                        ShapeTuple(leaves))
