"""Text generation with a compiled model library (tvmattn.build): load OUT.so into the Relax VM,
load OUT.params.npz, create the paged KV cache, tokenize, prefill then decode.

`Generator(lib_path).generate(prompts, ...)` returns a `Generation` (texts, token ids, timings);
one prompt goes through `prefill` / `decode`, several through `batch_prefill` / `batch_decode`.
Greedy when temperature == 0, otherwise temperature + top-p (nucleus) sampling with a seeded
numpy generator. `python -m tvmattn generate` is the command line over it.

Speculative (greedy) decoding: `generate_tokens(..., speculative=SpeculativeOptions(...))`
drafts token trees (prompt lookup, or a draft library: `DraftModel`), verifies every active
sequence's tree in one `batch_verify` step (begin_forward gets the trees' parent arrays) and
keeps the accepted path (`commit_accepted_token_tree_nodes`); tvmattn/speculative.py describes
the trees and the acceptance. Its tokens are those of plain greedy decoding; batches work as in
plain decoding. Where drafts do not pay (a verify step costs more than the tokens it is expected
to add), a step decodes plainly instead (`SpeculativeOptions.back_off`; the Generator's
`step_costs` measure both kinds of step as they run). Temperature > 0 is refused (no
speculative sampling).

The bundle's files are read and checked by tvmattn/bundle.py; every problem with them, and
every bad argument, is a GenerateError naming it.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
import json
import math
import os
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import tvm
import tvm_ffi
from tvm import relax
from tvm.runtime import ShapeTuple

from tir_kernels import support

from .runtime import ffi as _ffi  # noqa: F401  - registers tvmattn.* before the library is loaded
from .bundle import BundleError, load_params, load_tokenizer, open_bundle
from .speculative import (DRAFT_MODEL_PRIOR, PROMPT_LOOKUP_PRIOR, VERIFY_PRIOR_CPU, VERIFY_PRIOR_GPU, BackOff,
                          DraftOption, DraftTree, PromptLookup, SpeculativeOptions, SpeculativeStats, StepCosts,
                          accept_greedy, common_prefix, draft_model_tree, first_chain, next_draft_len, tree_depth)

# Prompt tokens per prefill call on the CPU: a 512-token prompt in two calls holds half the
# activations at the peak at the cost of a second pass over the weights; the GEMMs reuse each
# dequantized weight tile over every token of a call, so calls of 256 tokens keep that reuse
CPU_PREFILL_CHUNK = 256


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


class GenerateError(ValueError):
    """A missing or inconsistent library bundle, or a bad generation argument."""


def utf8_problem(text: str) -> str | None:
    """Why `text` cannot be encoded as UTF-8 (lone surrogates: bytes that were no UTF-8, as
    Python decodes such command-line arguments), or None."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        bad = text[err.start]
        shown = f"byte 0x{ord(bad) - 0xDC00:02x}" if 0xDC80 <= ord(bad) <= 0xDCFF else f"U+{ord(bad):04X}"
        return f"{shown} at character {err.start} is not UTF-8"
    return None


def _is_token(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _describe(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        kinds = sorted({type(v).__name__ for v in value})
        return f"a {type(value).__name__} of {', '.join(kinds)}" if kinds else f"an empty {type(value).__name__}"
    return type(value).__name__


def _check_sampling(max_new_tokens: Any, temperature: Any, top_p: Any, seed: Any) -> None:
    """GenerateError naming the first bad generation argument."""
    def number(value: Any) -> bool:
        return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)

    if not isinstance(max_new_tokens, (int, np.integer)) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        raise GenerateError(f"max_new_tokens (--max-new-tokens) must be an integer >= 1, got {max_new_tokens!r}")
    if not number(temperature) or not math.isfinite(temperature) or temperature < 0:
        raise GenerateError(f"temperature must be a finite number >= 0 (0: greedy), got {temperature!r}")
    if not number(top_p) or not 0 < top_p <= 1:  # NaN fails the comparison
        raise GenerateError(f"top_p must be a number in (0, 1], got {top_p!r}")
    if not isinstance(seed, (int, np.integer)) or isinstance(seed, bool) or not 0 <= seed < 2**64:
        raise GenerateError(f"seed must be an integer from 0 to 2**64 - 1, got {seed!r}")


@dataclasses.dataclass
class Generation:
    texts: list[str]
    tokens: list[list[int]]  # generated token ids per prompt (stop token excluded)
    prompt_tokens: list[int]  # prompt length per prompt
    prefill_s: float
    decode_s: float
    decode_steps: int
    # with keep_logits: per prompt, the float32 logits [len(tokens), vocab] each token was chosen from
    logits: list[np.ndarray] | None = None
    # speculative decoding only: trees verified (one per sequence and step), drafts fed, drafts accepted
    speculative: SpeculativeStats | None = None

    @property
    def prefill_tokens_per_s(self) -> float:
        return sum(self.prompt_tokens) / self.prefill_s if self.prefill_s > 0 else float("nan")

    @property
    def decode_tokens(self) -> int:
        """Tokens that came out of decode steps (each answer's first token comes from prefill)."""
        return sum(max(len(t) - 1, 0) for t in self.tokens)

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else float("nan")

    def summary(self) -> str:
        """One line of throughput, in tokens everywhere (the command line prints it)."""
        return (f"prefill: {sum(self.prompt_tokens)} prompt tokens in {self.prefill_s:.3f} s "
                f"({self.prefill_tokens_per_s:.1f} tokens/s); decode: {self.decode_tokens} tokens in "
                f"{self.decode_s:.3f} s ({self.decode_tokens_per_s:.1f} tokens/s, {self.decode_steps} steps of "
                f"batch <= {len(self.tokens)})")

    def speculative_summary(self) -> str:
        """One line of the speculative counts (empty for plain decoding)."""
        stats = self.speculative
        if stats is None:
            return ""
        return (f"speculative ({stats.mode}): {stats.accepted} of {stats.drafted} drafted tokens accepted "
                f"({100 * stats.acceptance_rate:.1f}%), {stats.mean_accepted:.2f} accepted per verify step "
                f"({stats.verify_steps} trees verified, {stats.plain_steps} plain steps where drafts did not pay "
                f"or none were found)")


def render_chat(template: str, prompt: str) -> str:
    """The chat template applied to one user message, with the assistant generation prompt.
    A template that does not parse or fails while rendering (it is code: an undefined name, a
    `raise_exception(...)` of its own) is a GenerateError."""
    import jinja2

    def raise_exception(message: str) -> None:  # what Hugging Face templates call to refuse input
        raise GenerateError(f"the chat template refuses the prompt: {message}")

    env = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(template).render(messages=[{"role": "user", "content": prompt}],
                                                add_generation_prompt=True, bos_token="", eos_token="")
    except GenerateError:
        raise
    except Exception as err:  # noqa: BLE001 - whatever the template's code raises
        raise GenerateError(f"the chat template does not render ({type(err).__name__}: {err}); send the prompt "
                            f"without it (chat=False, --no-chat) or recompile the library") from None


def sample(logits: np.ndarray, temperature: float, top_p: float, rng: np.random.Generator) -> int:
    """Greedy (temperature 0) or temperature + nucleus sampling of one row of logits."""
    if temperature <= 0:
        return int(np.argmax(logits))
    z = logits.astype(np.float64) / temperature
    probs = np.exp(z - z.max())
    probs /= probs.sum()
    order = np.argsort(-probs, kind="stable")
    cumulative = np.cumsum(probs[order])
    keep = order[: int(np.searchsorted(cumulative, top_p)) + 1]
    kept = probs[keep] / probs[keep].sum()
    return int(keep[rng.choice(len(keep), p=kept)])


# ---------------------------------------------------------------------- loading a bundle

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


def _check_finite(logits: np.ndarray, step: int, seq_ids: list[int]) -> None:
    """logits [len(seq_ids), vocab]: GenerateError naming the step and prompt of a non-finite row."""
    finite = np.isfinite(logits[:len(seq_ids)]).all(axis=-1)
    if not finite.all():
        seq_id = seq_ids[int(np.argmin(finite))]
        raise GenerateError(f"logits are not finite at step {step} ({'prefill' if step == 0 else 'decode'}) of "
                            f"prompt {seq_id}: the weights hold NaN or inf, or the library is broken; "
                            f"check the weights and recompile")



def library_decode_step(vm: relax.VirtualMachine, ids, cache, params, hidden: int):
    """One decode step of a model library from token ids [b] int32 on the device -> logits
    [b, 1, vocab] f32: what a CUDA graph captures. b = 1 runs `embed` then the static `decode`
    (whose matmuls get dlight's single-row GEMV, several times faster at one row than the
    symbolic-batch kernels); larger b runs `decode_step` (storage allocated once per VM)."""
    if ids.shape[0] == 1:
        embeds = vm["embed"](ids, params)._create_view((1, 1, hidden))
        logits, _ = vm["decode"](embeds, cache, params)
    else:
        logits, _ = vm["decode_step"](ids, cache, params)
    return logits


class Generator:
    """A loaded library bundle: VM, weights, tokenizer and KV cache.

    Before loading anything, OUT.runtime.json is checked field by field, and OUT.so and
    OUT.params.npz against the size and sha256 it recorded ("files"); bundles compiled before
    that record existed still load, without the checksum (their library's ELF headers and their
    parameters are still checked). Any broken file is a GenerateError naming it and the problem.
    """

    def __init__(self, lib_path: str | Path, cuda_graph: bool = True):
        """cuda_graph: on CUDA, replay plain decode steps as CUDA graphs (one per batch bucket,
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
        self.stop_ids = set(self.runtime.get("stop_token_ids") or [])
        kind = self.metadata["kv_cache"]["kind"]
        prefix = "tvmattn." if kind == "tvmattn" else "vm.builtin."
        self._host = {name: tvm.get_global_func(prefix + name) for name in
                      ("kv_state_add_sequence", "kv_state_remove_sequence", "kv_state_begin_forward",
                       "kv_state_end_forward", "kv_state_popn", "attention_kv_cache_commit_accepted_token_tree_nodes")}
        self.lib_path = lib_path
        # tokens per prefill call: the library's chunk, on the CPU at most CPU_PREFILL_CHUNK
        self.prefill_chunk = self.settings["prefill_chunk"]
        on_cpu = self.device.dlpack_device_type() == tvm.cpu().dlpack_device_type()
        if on_cpu:
            self.prefill_chunk = min(self.prefill_chunk, CPU_PREFILL_CHUNK)
        self._functions: dict[str, Any] = {}  # the VM's functions, looked up once (_function)
        # CPU: the decode step's token ids, a tensor per batch size written through a numpy view
        # (writing into it costs far less than a new tensor from numpy every step)
        self._cpu_ids: dict[int, tuple[Any, np.ndarray]] | None = (
            {} if on_cpu else None)
        self.cache = None
        # FP8 KV libraries (compile --kv-cache-dtype): scales [layers, 2, kv_heads] given to each
        # cache this generator creates (None: the cache's default, 1.0; tvmattn.calibrate_kv_scales)
        self.kv_scales = None
        self._capacity = 0
        self._drafts: dict[Path, Generator] = {}
        self._graphs = None  # DecodeGraphs of the current cache (see _graph_decode)
        self._graph_ids: dict[int, Any] = {}  # bucket -> its token-id input buffer on the device
        # what plain and speculative steps cost here, measured as they run: the speculative
        # loop's back-off weighs drafts against it (tvmattn/speculative.py)
        self.step_costs = StepCosts(VERIFY_PRIOR_CPU if on_cpu else VERIFY_PRIOR_GPU)

    @property
    def weight_bytes(self) -> int:
        """Bytes of the library's parameters (what a decode step reads)."""
        return sum(int(np.prod(p["shape"])) * support.numpy_dtype(p["dtype"]).itemsize for p in self.metadata["params"])

    def sibling(self) -> "Generator":
        """The same loaded library (VM, weights, tokenizer) with a KV cache of its own: a model
        drafting for itself."""
        other = copy.copy(self)
        other.cache, other._capacity, other._drafts = None, 0, {}
        other._graphs, other._graph_ids, other.cuda_graph = None, {}, False  # drafts run eagerly
        return other

    # ------------------------------------------------------------------ token level
    def _ensure_cache(self, needed: int, sequences: int = 1) -> None:
        """A KV cache for `needed` tokens over `sequences` sequences: sized to them (each
        sequence's last page is partly filled: a page each on top, at least 256 tokens in all),
        re-created only when a call needs more than the current one holds."""
        capacity = self.settings["context_window"] * self.settings["max_batch_size"]
        if needed > capacity:
            raise GenerateError(f"{needed} tokens do not fit the library's KV capacity "
                                f"({self.settings['max_batch_size']} x context window "
                                f"{self.settings['context_window']})")
        page = self.settings["page_size"]
        tokens = min(max(-(-needed // page) * page + sequences * page, 256), capacity)
        if self.cache is None or tokens > self._capacity:
            self.cache = None
            self.cache = self.vm["create_paged_kv_cache"](
                ShapeTuple([self.settings["max_batch_size"]]), ShapeTuple([tokens]),
                ShapeTuple([self.settings["prefill_chunk"]]), ShapeTuple([page]), ShapeTuple([0]))
            if self.kv_scales is not None:
                self.cache.set_kv_scales(self.kv_scales)
            self._capacity = tokens
            self._graphs, self._graph_ids = None, {}  # graphs belong to the cache they captured

    @property
    def uses_cuda_graph(self) -> bool:
        """Plain decode steps replay CUDA graphs (see __init__'s cuda_graph)."""
        from .runtime.cache import PagedKVCache

        return (self.cuda_graph and self.device.dlpack_device_type() == tvm.cuda(0).dlpack_device_type()
                and "decode_step" in self.metadata.get("functions", ()) and isinstance(self.cache, PagedKVCache)
                and self.cache.backend == "tir" and self.cache.graph_decode_supported)

    def _decode_step(self, bucket: int):
        return library_decode_step(self.vm, self._graph_ids[bucket], self.cache, self.params,
                                   self.metadata["model_config"]["hidden_size"])

    def _graph_decode(self, seq_ids: list[int], tokens: list[int]) -> np.ndarray:
        """One decode step replayed as a CUDA graph -> logits [len(seq_ids), vocab] f32."""
        from .runtime.graphs import DecodeGraphs, bucket_of

        if self._graphs is None:
            self._graphs = DecodeGraphs(self.cache, self._decode_step, self.settings["max_batch_size"])
        bucket = bucket_of(len(seq_ids), self._graphs.buckets)
        ids = self._graph_ids.get(bucket)
        if ids is None:
            ids = self._graph_ids[bucket] = tvm.runtime.empty((bucket,), "int32", device=self.device)
        host = np.zeros(bucket, np.int32)
        host[: len(tokens)] = tokens
        ids.copyfrom(host)
        return self._graphs.run(seq_ids).numpy()[: len(seq_ids), 0]

    def _function(self, name: str):
        """The library's function `name`, looked up once."""
        function = self._functions.get(name)
        if function is None:
            function = self._functions[name] = self.vm[name]
        return function

    def _embed(self, tokens: list[int]) -> np.ndarray:
        ids = tvm.runtime.tensor(np.array(tokens, dtype=np.int32), device=self.device)
        return self._function("embed")(ids, self.params).numpy()

    def decode_step(self, seq_ids: list[int], tokens: list[int], single: bool = True) -> np.ndarray:
        """One plain decode step of `tokens` (one per sequence) -> logits [len(seq_ids), vocab]
        f32, as generate_tokens runs it: a CUDA graph where it uses them; else the embedding
        lookup feeds the step on the device (no copy to the host and back), through `decode`
        for a single sequence (`single`: the generation has one prompt), `batch_decode` otherwise."""
        if self.uses_cuda_graph:
            return self._graph_decode(seq_ids, tokens)
        ids = self._token_ids(tokens)
        hidden = self.metadata["model_config"]["hidden_size"]
        embeds = self._function("embed")(ids, self.params)._create_view((len(tokens), 1, hidden))
        if single and len(seq_ids) == 1:
            return self._forward("decode", seq_ids, [1], embeds)[:, 0]
        return self._forward("batch_decode", seq_ids, [1] * len(seq_ids), embeds)[:, 0]

    def _token_ids(self, tokens: list[int]):
        """tokens as an int32 tensor [len(tokens)] on the device (on the CPU the same tensor for
        every step of a batch size: the step reads it before it returns)."""
        if self._cpu_ids is None:
            return tvm.runtime.tensor(np.array(tokens, dtype=np.int32), device=self.device)
        entry = self._cpu_ids.get(len(tokens))
        if entry is None:
            ids = tvm.runtime.empty((len(tokens),), "int32", device=self.device)
            entry = self._cpu_ids[len(tokens)] = (ids, np.from_dlpack(ids))
        entry[1][:] = tokens
        return entry[0]

    def _forward(self, function: str, seq_ids: list[int], lengths: list[int], embeds, *extra,
                 parents: list[int] | None = None):
        """embeds: a host array, or a tensor already on the device."""
        tree = () if parents is None else (ShapeTuple(parents),)
        one_each = function in ("prefill", "batch_prefill") and all(n == 1 for n in lengths)
        if one_each:
            # the cache plans a step of one token per sequence as a decode step (TVM's rule; an
            # MLA library's prefill functions would then count the new tokens twice): decode it
            function, extra, embeds = "batch_decode", (), embeds.reshape(len(seq_ids), 1, -1)
        if isinstance(embeds, np.ndarray):
            embeds = tvm.runtime.tensor(embeds, device=self.device)
        self._host["kv_state_begin_forward"](self.cache, ShapeTuple(seq_ids), ShapeTuple(lengths), *tree)
        logits, _ = self._function(function)(embeds, *extra, self.cache, self.params)
        self._host["kv_state_end_forward"](self.cache)
        logits = logits.numpy()
        return logits.reshape(1, len(seq_ids), -1) if one_each else logits

    def _prefill(self, seq_ids: list[int], prompts: list[list[int]]) -> np.ndarray:
        """-> [len(prompts), vocab] logits of each prompt's last token."""
        chunk = self.prefill_chunk
        total = sum(len(p) for p in prompts)
        if len(prompts) > 1 and total <= chunk:
            embeds = self._embed([t for p in prompts for t in p])[None]
            ends = np.cumsum([len(p) for p in prompts]).astype(np.int32) - 1
            positions = tvm.runtime.tensor(ends, device=self.device)
            return self._forward("batch_prefill", seq_ids, [len(p) for p in prompts], embeds, positions)[0]
        rows = []
        for seq_id, prompt in zip(seq_ids, prompts):  # one sequence at a time, in chunks
            for begin in range(0, len(prompt), chunk):
                piece = prompt[begin:begin + chunk]
                logits = self._forward("prefill", [seq_id], [len(piece)], self._embed(piece)[None])
            rows.append(logits[0, 0])
        return np.stack(rows)

    @no_cyclic_gc()
    def generate_tokens(self, prompts: list[list[int]], max_new_tokens: int = 32, temperature: float = 0.0,
                        top_p: float = 1.0, seed: int = 0,
                        on_token: Callable[[int, int], None] | None = None, keep_logits: bool = False,
                        on_finish: Callable[[int], None] | None = None,
                        speculative: SpeculativeOptions | None = None) -> Generation:
        """Generate from token-id prompts; on_token(prompt index, token) is called per new token,
        on_finish(prompt index) when that prompt's answer is complete;
        keep_logits: also return the logits each token was chosen from (Generation.logits);
        speculative: greedy speculative decoding (temperature must be 0), same tokens.
        prompts: a list of token-id lists (a batch), or one list of token ids (one prompt)."""
        if isinstance(prompts, (list, tuple)) and prompts and all(_is_token(t) for t in prompts):
            prompts = [prompts]
        if (not isinstance(prompts, (list, tuple))
                or not all(isinstance(p, (list, tuple)) and all(_is_token(t) for t in p) for p in prompts)):
            raise GenerateError(f"prompts must be a list of token-id lists, got {_describe(prompts)}")
        if not prompts or any(len(p) == 0 for p in prompts):
            raise GenerateError("every prompt needs at least one token")
        prompts = [[int(t) for t in p] for p in prompts]
        if len(prompts) > self.settings["max_batch_size"]:
            raise GenerateError(f"{len(prompts)} prompts exceed the library's max batch size "
                                f"{self.settings['max_batch_size']}")
        _check_sampling(max_new_tokens, temperature, top_p, seed)
        if speculative is not None:
            self._check_speculative(speculative, temperature)
        vocab = self.metadata["model_config"]["vocab_size"]
        for index, prompt in enumerate(prompts):  # the library's embedding lookup does not check its indices
            outside = next((t for t in prompt if not 0 <= t < vocab), None)
            if outside is not None:
                raise GenerateError(f"prompt {index}: token id {outside} is outside the vocabulary [0, {vocab})")
        longest = max(len(p) for p in prompts) + max_new_tokens
        if longest > self.settings["context_window"]:
            raise GenerateError(f"prompt + {max_new_tokens} new tokens = {longest} tokens exceed the context "
                                f"window {self.settings['context_window']}")
        # a speculative step holds its tree's nodes (at most draft_len + 1 a sequence) before the commit
        tree = speculative.draft_len + 1 if speculative is not None else 0
        self._ensure_cache(sum(len(p) for p in prompts) + len(prompts) * (max_new_tokens + tree), len(prompts))
        rng = np.random.default_rng(seed)
        seq_ids = list(range(len(prompts)))
        for seq_id in seq_ids:
            self._host["kv_state_add_sequence"](self.cache, seq_id)
        generated: list[list[int]] = [[] for _ in prompts]
        kept: list[list[np.ndarray]] = [[] for _ in prompts]
        drafter = None
        try:
            start = time.perf_counter()
            logits = self._prefill(seq_ids, prompts)
            if speculative is not None and speculative.mode == "draft-model":  # the draft model's prefill
                drafter = DraftModel(self._draft_generator(speculative), seq_ids, speculative.tree_width,
                                     sum(len(p) for p in prompts) + len(prompts) * (max_new_tokens
                                                                                    + speculative.draft_len),
                                     max(len(p) for p in prompts) + max_new_tokens + speculative.draft_len)
                drafter.prefill(seq_ids, prompts)
            prefill_s = time.perf_counter() - start
            _check_finite(logits, 0, seq_ids)
            if speculative is not None:
                start = time.perf_counter()
                steps, stats = self._speculative_loop(speculative, prompts, logits, generated, kept, max_new_tokens,
                                                      on_token, on_finish, keep_logits, drafter)
                decode_s = time.perf_counter() - start
                return Generation([], generated, [len(p) for p in prompts], prefill_s, decode_s, steps,
                                  [np.stack(rows) if rows else np.zeros((0, 0), np.float32) for rows in kept]
                                  if keep_logits else None, stats)
            active = list(seq_ids)
            steps = 0
            start = time.perf_counter()
            while True:
                next_active, tokens = [], []
                for row, seq_id in enumerate(active):
                    token = sample(logits[row], temperature, top_p, rng)
                    if token in self.stop_ids:
                        continue
                    generated[seq_id].append(token)
                    if keep_logits:
                        kept[seq_id].append(np.array(logits[row], dtype=np.float32))
                    if on_token is not None:
                        on_token(seq_id, token)
                    if len(generated[seq_id]) < max_new_tokens:
                        next_active.append(seq_id)
                        tokens.append(token)
                if on_finish is not None:
                    for seq_id in sorted(set(active) - set(next_active)):  # hit a stop token or the limit
                        on_finish(seq_id)
                active = next_active
                if not active:
                    break
                step_start = time.perf_counter()
                logits = self.decode_step(active, tokens, single=len(prompts) == 1)
                self.step_costs.observe_plain(len(active), time.perf_counter() - step_start)
                steps += 1
                _check_finite(logits, steps, active)
            decode_s = time.perf_counter() - start
        finally:
            for seq_id in seq_ids:
                self._host["kv_state_remove_sequence"](self.cache, seq_id)
            if drafter is not None:
                drafter.close()
        return Generation([], generated, [len(p) for p in prompts], prefill_s, decode_s, steps,
                          [np.stack(rows) if rows else np.zeros((0, 0), np.float32) for rows in kept]
                          if keep_logits else None)

    # ------------------------------------------------------------------ speculative decoding
    def _check_speculative(self, options: SpeculativeOptions, temperature: float) -> None:
        if temperature > 0:
            raise GenerateError(f"speculative decoding is greedy only: temperature must be 0, got {temperature} "
                                f"(speculative sampling is not implemented)")
        if "batch_verify" not in self.metadata.get("functions", []):
            raise GenerateError(f"{self.lib_path} has no batch_verify function (compiled before speculative "
                                f"decoding existed); recompile it")
        if options.mode == "draft-model":
            self._draft_generator(options)

    def _draft_generator(self, options: SpeculativeOptions) -> "Generator":
        """The drafting library of options.draft_lib (loaded once; this library itself when it
        is the same file), checked to share this one's vocabulary."""
        path = Path(options.draft_lib)
        if path.resolve() == self.lib_path.resolve():
            return self.sibling()
        key = path.resolve()
        if key not in self._drafts:
            try:
                draft = Generator(path)
            except GenerateError as err:
                raise GenerateError(f"--draft-lib: {err}") from None
            ours, theirs = self.metadata["model_config"]["vocab_size"], draft.metadata["model_config"]["vocab_size"]
            if ours != theirs or (self.tokenizer is not None and draft.tokenizer is not None
                                  and self.tokenizer.get_vocab() != draft.tokenizer.get_vocab()):
                raise GenerateError(f"--draft-lib {str(path)!r}: its vocabulary ({theirs} tokens) differs from that "
                                    f"of {self.lib_path} ({ours}); the draft model needs the same tokenizer")
            self._drafts[key] = draft
        return self._drafts[key]

    def _verify(self, seq_ids: list[int], trees: list[DraftTree], step: int) -> list[np.ndarray]:
        """One batch_verify step over the sequences' trees -> the logits [len(tree), vocab] of
        each tree's nodes. The trees stay uncommitted in the cache (see _commit)."""
        tokens = [t for tree in trees for t in tree.tokens]
        parents = [p for tree in trees for p in tree.parents]
        logits = self._forward("batch_verify", seq_ids, [len(t) for t in trees], self._embed(tokens)[None],
                               parents=parents)[0]
        _check_finite(logits, step, [s for s, tree in zip(seq_ids, trees) for _ in tree.tokens])
        ends = np.cumsum([len(t) for t in trees])
        return [logits[end - len(tree):end] for end, tree in zip(ends, trees)]

    def _commit(self, seq_ids: list[int], leaves: list[int]) -> None:
        self._host["attention_kv_cache_commit_accepted_token_tree_nodes"](self.cache, ShapeTuple(seq_ids),
                                                                          ShapeTuple(leaves))

    def _speculative_loop(self, options: SpeculativeOptions, prompts: list[list[int]], logits: np.ndarray,
                          generated: list[list[int]], kept: list[list[np.ndarray]], max_new_tokens: int,
                          on_token, on_finish, keep_logits: bool,
                          drafter: DraftModel | None = None) -> tuple[int, SpeculativeStats]:
        """Greedy speculative decoding after the prefill (logits: each prompt's last row; drafter:
        the draft model, prefilled, for mode draft-model) -> (model steps, counts). Fills
        generated / kept as the plain loop does."""
        stats = SpeculativeStats(options.mode)
        seq_ids = list(range(len(prompts)))

        def emit(seq_id: int, token: int, row: np.ndarray) -> bool:
            """Append a chosen token; False when the sequence is complete."""
            if token in self.stop_ids:
                return False
            generated[seq_id].append(token)
            if keep_logits:
                kept[seq_id].append(np.array(row, dtype=np.float32))
            if on_token is not None:
                on_token(seq_id, token)
            return len(generated[seq_id]) < max_new_tokens

        def finish(seq_id: int) -> None:
            if on_finish is not None:
                on_finish(seq_id)

        active = []
        for row, seq_id in enumerate(seq_ids):
            if emit(seq_id, int(np.argmax(logits[row])), logits[row]):
                active.append(seq_id)
            else:
                finish(seq_id)
        if options.mode == "prompt-lookup":
            drafter = PromptLookup(options.draft_len, options.tree_width, options.max_ngram, options.min_ngram)
        back_off = None
        if options.back_off:
            lookup = options.mode == "prompt-lookup"
            back_off = BackOff(self.step_costs, PROMPT_LOOKUP_PRIOR if lookup else DRAFT_MODEL_PRIOR,
                               None if lookup else drafter.generator.weight_bytes / self.weight_bytes)
        limits = {seq_id: options.draft_len for seq_id in seq_ids}  # per-sequence draft length
        single = len(prompts) == 1
        steps = 0
        while active:
            # a tree's drafts beyond what the answer can still take are useless; all trees
            # of a step (root + drafts each) must fit one prefill chunk
            room = self.settings["prefill_chunk"] // len(active) - 1
            contexts = [prompts[s] + generated[s] for s in active]
            budgets = [min(limits[s], max_new_tokens - len(generated[s]) - 1, room) for s in active]
            if isinstance(drafter, PromptLookup):
                trees = [drafter.draft(c, b) for c, b in zip(contexts, budgets)]
                if back_off is not None:
                    trees = self._back_off_lookup(back_off, active, trees, generated)
            else:
                if back_off is not None:
                    budgets = self._back_off_draft_model(back_off, active, budgets, options.tree_width)
                draft_start = time.perf_counter()
                trees = drafter.draft(active, contexts, budgets)
                drafted = sum(t.num_drafts for t in trees)
                if drafted:
                    self.step_costs.observe_draft(drafted, time.perf_counter() - draft_start)
            steps += 1
            step_start = time.perf_counter()
            if all(t.num_drafts == 0 for t in trees):  # nothing drafted, or drafts do not pay: a plain step
                rows = self.decode_step(active, [c[-1] for c in contexts], single=single)
                self.step_costs.observe_plain(len(active), time.perf_counter() - step_start)
                _check_finite(rows, steps, active)
                node_logits = [rows[i:i + 1] for i in range(len(active))]
            else:
                node_logits = self._verify(active, trees, steps)
                self.step_costs.observe_verify(sum(len(t) for t in trees), time.perf_counter() - step_start)
            accepted = [accept_greedy(tree, rows) for tree, rows in zip(trees, node_logits)]
            if any(t.num_drafts for t in trees):
                self._commit(active, [path[-1] for path, _ in accepted])
            next_active = []
            for seq_id, tree, rows, (path, bonus) in zip(active, trees, node_logits, accepted):
                if tree.num_drafts:
                    stats.verify_steps += 1
                    stats.drafted += tree.num_drafts
                    stats.accepted += len(path) - 1
                    if options.adaptive:
                        limits[seq_id] = next_draft_len(limits[seq_id], len(path) - 1, tree_depth(tree),
                                                        options.draft_len)
                    if back_off is not None:
                        back_off.verified(seq_id, len(path) - 1, tree_depth(tree))
                else:
                    stats.plain_steps += 1
                chosen = [(tree.tokens[node], rows[parent]) for parent, node in zip(path, path[1:])]
                chosen.append((bonus, rows[path[-1]]))
                going = all(emit(seq_id, token, row) for token, row in chosen)
                shadow = back_off.check_shadow(seq_id, generated[seq_id]) if back_off is not None else None
                if shadow is not None and options.adaptive:
                    limits[seq_id] = next_draft_len(limits[seq_id], shadow[0], shadow[1], options.draft_len)
                if going:
                    next_active.append(seq_id)
                else:
                    finish(seq_id)
            active = next_active
        return steps, stats

    @staticmethod
    def _back_off_lookup(back_off: BackOff, active: list[int], trees: list[DraftTree],
                         generated: list[list[int]]) -> list[DraftTree]:
        """Prompt lookup's trees with those that do not pay cut back to their roots; a cut draft
        becomes the sequence's shadow draft (BackOff.shadow)."""
        options = {s: [DraftOption(t.num_drafts, tree_depth(t))] for s, t in zip(active, trees) if t.num_drafts}
        plan = back_off.plan(options, len(active))
        kept = []
        for seq_id, tree in zip(active, trees):
            if tree.num_drafts and seq_id not in plan:
                back_off.shadow(seq_id, len(generated[seq_id]), first_chain(tree))
                tree = DraftTree.root(tree.tokens[0])
            kept.append(tree)
        return kept

    @staticmethod
    def _back_off_draft_model(back_off: BackOff, active: list[int], budgets: list[int], width: int) -> list[int]:
        """The draft model's budgets after the back-off's plan (0: the sequence does not draft,
        and its evidence fades toward the prior)."""
        options = {}
        for seq_id, budget in zip(active, budgets):
            sizes = sorted({min(2 ** i, budget) for i in range(budget.bit_length())} | {budget}) if budget >= 1 else []
            options[seq_id] = [DraftOption(k, k - min(width, k) + 1) for k in sizes]
        plan = back_off.plan(options, len(active))
        for seq_id in active:
            if seq_id not in plan:
                back_off.of(seq_id).fade()
        return [plan.get(seq_id, 0) for seq_id in active]

    # ------------------------------------------------------------------ text level
    def encode(self, prompt: str, chat: bool = True) -> list[int]:
        """Token ids of a text prompt (through the chat template unless chat=False)."""
        if self.tokenizer is None:
            raise GenerateError("the library bundle has no tokenizer (compile from a .gguf file)")
        if not isinstance(prompt, str):
            raise GenerateError(f"a prompt must be a string, got {type(prompt).__name__}")
        problem = utf8_problem(prompt)
        if problem:
            raise GenerateError(f"the prompt is not valid text: {problem}")
        template = self.runtime.get("chat_template")
        if chat and template:
            return self.tokenizer.encode(render_chat(template, prompt), add_special_tokens=False).ids
        return self.tokenizer.encode(prompt).ids

    def generate(self, prompts: str | list[str], max_new_tokens: int = 32, temperature: float = 0.0,
                 top_p: float = 1.0, seed: int = 0, chat: bool = True, stream: Callable[[str], None] | None = None,
                 on_answer: Callable[[int, str], None] | None = None,
                 speculative: SpeculativeOptions | None = None) -> Generation:
        """Generate from text prompts: a list of strings (a batch), or one string (one prompt).

        stream(text piece): with one prompt, called as its text arrives (a piece never ends inside
        a UTF-8 sequence); on_answer(prompt index, text): called once per prompt as soon as its
        answer is complete (answers of a batch arrive in the order they finish).
        """
        if isinstance(prompts, str):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)) or not all(isinstance(p, str) for p in prompts):
            raise GenerateError(f"prompts must be a string or a list of strings, got {_describe(prompts)}")
        if not prompts:
            raise GenerateError("prompts is empty: give at least one prompt")
        if stream is not None and len(prompts) != 1:
            raise GenerateError(f"stream needs exactly one prompt, got {len(prompts)}; use on_answer for a batch")
        ids = []
        for index, prompt in enumerate(prompts):
            try:
                ids.append(self.encode(prompt, chat))
            except GenerateError as err:
                raise GenerateError(f"prompt {index}: {err}" if len(prompts) > 1 else str(err)) from None
        tokens: list[list[int]] = [[] for _ in prompts]
        shown = [""]

        def on_token(index: int, token: int) -> None:
            tokens[index].append(token)
            if stream is None:
                return
            text = self.tokenizer.decode(tokens[0])
            if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the next token
                return
            stream(text[len(shown[0]):])
            shown[0] = text

        def on_finish(index: int) -> None:
            if on_answer is not None:
                on_answer(index, self.tokenizer.decode(tokens[index]))

        result = self.generate_tokens(ids, max_new_tokens, temperature, top_p, seed, on_token=on_token,
                                      on_finish=on_finish, speculative=speculative)
        result.texts = [self.tokenizer.decode(t) for t in result.tokens]
        if stream is not None and result.texts[0] != shown[0]:
            stream(result.texts[0][len(shown[0]):])
        return result


class DraftModel:
    """A drafting library with a KV cache of its own (tvmattn/speculative.py): greedy drafts,
    the top `width` tokens at the first draft position; its cache is rolled back (popn) to the
    longest prefix it shares with each sequence before the next draft."""

    def __init__(self, generator: Generator, seq_ids: list[int], width: int, total_tokens: int, longest: int):
        if longest > generator.settings["context_window"]:
            raise GenerateError(f"--draft-lib {str(generator.lib_path)!r}: {longest} tokens (prompt, answer and "
                                f"draft) exceed its context window {generator.settings['context_window']}")
        if len(seq_ids) > generator.settings["max_batch_size"]:
            raise GenerateError(f"--draft-lib {str(generator.lib_path)!r}: {len(seq_ids)} prompts exceed its max "
                                f"batch size {generator.settings['max_batch_size']}")
        self.generator, self.width = generator, width
        generator._ensure_cache(total_tokens, len(seq_ids))
        self.cached: dict[int, list[int]] = {}
        for seq_id in seq_ids:
            generator._host["kv_state_add_sequence"](generator.cache, seq_id)
            self.cached[seq_id] = []

    def prefill(self, seq_ids: list[int], prompts: list[list[int]]) -> None:
        """Feed the prompts (part of the prefill step: the drafts then need one token's feed)."""
        self.generator._prefill(seq_ids, prompts)
        for seq_id, prompt in zip(seq_ids, prompts):
            self.cached[seq_id] = list(prompt)

    def close(self) -> None:
        for seq_id in self.cached:
            self.generator._host["kv_state_remove_sequence"](self.generator.cache, seq_id)
        self.cached = {}

    def draft(self, seq_ids: list[int], contexts: list[list[int]], budgets: list[int]) -> list[DraftTree]:
        """One tree per sequence (contexts end with the pending token) of at most budgets[i] drafts."""
        g = self.generator
        trees = [DraftTree.root(c[-1]) for c in contexts]
        want = [i for i, b in enumerate(budgets) if b >= 1]
        if not want:
            return trees
        feeds = []
        for i in want:  # roll the draft cache back to what it shares with the sequence
            have, context = self.cached[seq_ids[i]], contexts[i]
            keep = min(common_prefix(have, context), len(context) - 1)  # the last token is fed for its logits
            if keep < len(have):
                g._host["kv_state_popn"](g.cache, seq_ids[i], len(have) - keep)
                del have[keep:]
            feeds.append(context[keep:])
            have.extend(context[keep:])
        first = g._prefill([seq_ids[i] for i in want], feeds)
        widths = {i: min(self.width, budgets[i]) for i in want}
        chains: dict[int, list[int]] = {i: [] for i in want}
        current = {i: int(np.argmax(first[k])) for k, i in enumerate(want)}
        while True:  # greedy chain below the best first token
            going = [i for i in want if len(chains[i]) < budgets[i] - widths[i]]
            if not going:
                break
            embeds = g._embed([current[i] for i in going])[:, None, :]
            rows = g._forward("decode" if len(going) == 1 else "batch_decode", [seq_ids[i] for i in going],
                              [1] * len(going), embeds)[:, 0]
            for k, i in enumerate(going):
                self.cached[seq_ids[i]].append(current[i])
                current[i] = int(np.argmax(rows[k]))
                chains[i].append(current[i])
        for k, i in enumerate(want):
            trees[i] = draft_model_tree(contexts[i][-1], first[k], chains[i], widths[i])
        return trees
