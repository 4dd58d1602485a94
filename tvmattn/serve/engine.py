"""The continuous-batching engine: a request queue, a scheduler and one step loop over a
`ModelRunner` (one library, one paged KV cache).

Requests join and leave between steps. Each step spends a token budget (`max_batched_tokens`):
first one token for every running request that is decoding (or its speculative draft tree),
then chunks of prompts still being prefilled, oldest first, then new requests from the queue
(chunked prefill: a long prompt is fed over several steps beside the running streams, never
stalling them for its whole prefill). A step of decode tokens alone runs the library's decode
(CUDA graphs where the session replays them); a step that holds prompt chunks runs
`batch_prefill` over all of them at once.

Speculative decoding (greedy requests that ask for it): a decoding request's token becomes the
root of a draft tree, drafted by prompt lookup or by a draft model (`DraftModel`, a second
library), and a step whose decode tokens hold a tree verifies them all in one `batch_verify`
(tvmattn/speculative.py describes the trees, the acceptance and the back-off that skips drafts
where they do not pay, from the session's measured step costs). The tokens are those of plain
greedy decoding.

Lookahead (on an accelerator, sampling on the device): in steady decoding the host does not
wait for a step's tokens before launching the next. A plain decode step whose requests all
sample on the device (no grammar, logprobs, penalties, kept logits or speculation) is left in
flight; the next `step()` launches the following decode step with the first one's `sample`
output as its input ids (`ModelRunner.decode_fed`, never read by the host), and only then reads
and emits the first step's tokens while the GPU runs the second. A request that the read token
ends (a stop token or string, its length) has one token too many in its cache sequence: it is
popped before the sequence is recorded in the prefix cache, and the second step's row for it is
dropped. The tokens are the same as without lookahead (the same draws in the same order);
anything else (a new request, a cancellation, a request near max_tokens, pages running short)
lets the step in flight finish first and the scheduler run as usual.

Memory: a new request forks its cache sequence from the longest cached prefix (`prefix.py`) and
prefills the rest. Before a step, the pages it needs are counted; when they run short, the
prefix cache's least-recently-used leaves are evicted, then prompt chunks wait, then the newest
running request is preempted (its sequence removed, its pages freed, the request put back at
the head of the queue with its tokens so far; it is recomputed when pages are free and goes on
where it stopped: nothing is truncated). A request that can never fit (prompt + max_tokens over
the context window or the page pool) is refused at submission.

Threads: `start()` runs the step loop in one background thread; it alone touches the cache.
`submit` and `cancel` may be called from any thread; a request's events arrive through its
`RequestStream`, readable by blocking iteration or from asyncio (`async for`). Without
`start()`, the caller drives the loop itself (`step()` until it returns False, reading
`stream.ready()` between steps): what `tvmattn.generate.Generator` does.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import queue
import threading
import time
from typing import Any, Callable

import numpy as np

from ..device_sampling import PendingChoices, served_on_device
from ..sampling import Sampler, SamplingOptions, TokenLogprob
from ..session import GenerateError
from ..speculative import (DRAFT_MODEL_PRIOR, PROMPT_LOOKUP_PRIOR, BackOff, DraftOption, DraftTree, PromptLookup,
                           SpeculativeOptions, SpeculativeStats, accept_argmax, accept_greedy, first_chain,
                           next_draft_len, tree_depth)
from .prefix import RadixPrefixCache
from .runner import DraftModel, ModelRunner
from .text import TextStream

PREFIX_CACHE_MODES = ("radix", "off")
# "device": the library's sampling kernels choose the tokens of the rows they serve (the host
# reads back token ids only); "host": every row of logits is copied and sampled by
# tvmattn.sampling; "auto": "device" on an accelerator where the library has the kernels, "host"
# on the CPU (ModelSession.auto_sampler)
SAMPLING_MODES = ("auto", "device", "host")


class RequestError(ValueError):
    """A request refused at submission; `status` is the HTTP status it maps to (400: bad field,
    413: can never fit, 429: queue full, 503: draining)."""

    def __init__(self, message: str, status: int = 400, param: str | None = None):
        super().__init__(message)
        self.status, self.param = status, param


@dataclasses.dataclass
class RequestOutput:
    """The complete answer of a request (the last event carries it)."""

    request_id: int
    prompt_tokens: int
    tokens: list[int]
    text: str
    finish_reason: str  # "stop", "length" or "cancelled"
    cached_tokens: int  # prompt tokens found in the prefix cache (first admission)
    ttft_s: float | None
    latency_s: float
    preemptions: int
    logprobs: list[TokenLogprob] | None = None

    @property
    def completion_tokens(self) -> int:
        return len(self.tokens)


@dataclasses.dataclass
class Event:
    """A delta of a request: new text (may be empty), the new token ids and their logprobs;
    the last event has finish_reason and output set."""

    text: str
    tokens: list[int]
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    output: RequestOutput | None = None


class RequestStream:
    """A request's events, put by the step thread; read them with `for event in stream`
    (blocking), `async for event in stream` (asyncio: the loop given at submission), or
    `stream.result()` for the RequestOutput."""

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None):
        self._queue: queue.Queue = queue.Queue()
        self._loop = loop
        self._async: asyncio.Queue | None = asyncio.Queue() if loop is not None else None
        self.done = False
        self.output: RequestOutput | None = None  # set by the last event read

    def put(self, event: Event) -> None:
        if self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(self._async.put_nowait, event)
            except RuntimeError:  # the loop is closed: nobody reads any more
                pass
        else:
            self._queue.put(event)

    def __iter__(self):
        while not self.done:
            event = self._queue.get()
            if event.finish_reason is not None:
                self.done, self.output = True, event.output
            yield event

    async def __aiter__(self):
        while not self.done:
            event = await self._async.get()
            if event.finish_reason is not None:
                self.done, self.output = True, event.output
            yield event

    def ready(self) -> list[Event]:
        """The events put so far and not read yet, without waiting (a loop driven by `step`)."""
        events = []
        while not self.done and not self._queue.empty():
            event = self._queue.get_nowait()
            if event.finish_reason is not None:
                self.done, self.output = True, event.output
            events.append(event)
        return events

    def result(self) -> RequestOutput:
        """The RequestOutput, after reading (blocking) the events not read yet."""
        for _ in self:
            pass
        return self.output


class Request:
    """One request's state (owned by the step thread after submission)."""

    def __init__(self, request_id: int, prompt: list[int], options: SamplingOptions, sampler: Sampler,
                 stream: RequestStream, text: TextStream, speculative: bool, grammar: Any, name: str,
                 keep_logits: bool):
        self.id = request_id
        self.prompt_len = len(prompt)
        self.tokens = list(prompt)  # prompt + generated
        self.options = options
        self.sampler = sampler
        self.stream = stream
        self.text = text
        self.speculative = speculative
        self.name = name  # what errors call it
        self.grammar = grammar  # None, or an object with allowed() -> bool mask, accept(token), done
        self.seq_id: int | None = None
        self.cached = 0  # tokens of self.tokens in the cache sequence
        self.arrival = time.perf_counter()
        self.first_token: float | None = None
        self.last_token: float | None = None
        self.preemptions = 0
        self.cached_prompt: int | None = None  # prefix-cache hit of the first admission
        self.prompt_recorded = False  # its prompt is in the prefix cache
        self.draft_limit = 0
        self.draft_fed = False  # its prompt is in the draft model's cache
        self.stats: SpeculativeStats | None = None  # speculative requests: their counts
        self.logprobs: list[TokenLogprob] | None = [] if options.logprobs else None
        self.kept: list[np.ndarray] | None = [] if keep_logits else None  # the rows its tokens were chosen from
        self.finished = False
        # tokens its cache sequence holds after self.tokens that the host has not read yet: a
        # lookahead step appended the sampled token of the step still in flight (0 or 1)
        self.unseen = 0

    @property
    def output(self) -> list[int]:
        return self.tokens[self.prompt_len:]

    @property
    def pending(self) -> int:
        """Tokens not yet in the cache (>= 1 for a running request: at least the last chosen)."""
        return len(self.tokens) - self.cached


@dataclasses.dataclass
class _Launched:
    """A plain decode step on the device whose token choices the host has not read (lookahead):
    its requests in row order and the sampling kernels' pending choices."""

    requests: list[Request]
    pending: PendingChoices


@dataclasses.dataclass
class _Chunk:
    request: Request
    tokens: list[int]
    parents: list[int] | None = None  # a draft tree (speculative); None: a chain
    tree: Any = None


def _pages(length: int, page_size: int) -> int:
    return -(-length // page_size)


class Engine:
    """See the module docstring.

    runner: the loaded model; max_batched_tokens: tokens per step (at most the library's prefill
    chunk; default the session's prefill call size, at most 512); max_running: requests with a
    cache sequence at once (default the library's max batch size); max_queue: waiting requests
    beyond which submit refuses (429); prefix_cache: "radix" or "off"; speculative: the options
    of requests that ask for speculation (default: prompt lookup); draft_model: the drafting
    library of mode "draft-model"; sampling: one of SAMPLING_MODES (the mode in use is
    `self.sampling`, "device" or "host"); lookahead: launch each steady decode step before
    reading the previous one's tokens (module docstring; None: where the device runs
    asynchronously, sampling is on the device and the library exports `feed_tokens`; True
    needs the latter two)."""

    def __init__(self, runner: ModelRunner, *, max_batched_tokens: int | None = None,
                 max_running: int | None = None, max_queue: int = 256, prefix_cache: str = "radix",
                 speculative: SpeculativeOptions | None = None, draft_model: DraftModel | None = None,
                 sampling: str = "auto", lookahead: bool | None = None):
        if prefix_cache not in PREFIX_CACHE_MODES:
            raise ValueError(f"prefix_cache must be one of {PREFIX_CACHE_MODES}, got {prefix_cache!r}")
        if sampling not in SAMPLING_MODES:
            raise ValueError(f"sampling must be one of {SAMPLING_MODES}, got {sampling!r}")
        chunk = runner.prefill_chunk
        if max_batched_tokens is None:  # the session's prefill call size (smaller on the CPU), at most 512
            max_batched_tokens = min(runner.session.prefill_chunk, 512)
        if not isinstance(max_batched_tokens, int) or not 1 <= max_batched_tokens <= chunk:
            raise ValueError(f"max_batched_tokens must be from 1 to the library's prefill chunk {chunk}, "
                             f"got {max_batched_tokens!r}")
        max_running = runner.max_batch_size if max_running is None else max_running
        if not 1 <= max_running <= runner.max_batch_size:
            raise ValueError(f"max_running must be from 1 to the library's max batch size {runner.max_batch_size}, "
                             f"got {max_running}")
        if not isinstance(max_queue, int) or max_queue < 1:
            raise ValueError(f"max_queue must be a positive integer, got {max_queue!r}")
        self._sampler = {"auto": runner.session.auto_sampler, "device": runner.session.device_sampler,
                         "host": lambda: None}[sampling]()
        if sampling == "device" and self._sampler is None:
            raise ValueError(f"sampling='device': {runner.session.lib_path} has no sampling kernels that flag "
                             f"non-finite logits (compiled before them); recompile it, or sample on the host")
        self.sampling = "device" if self._sampler is not None else "host"
        if lookahead not in (None, True, False):
            raise ValueError(f"lookahead must be True, False or None (automatic), got {lookahead!r}")
        problem = None
        if self._sampler is None:
            problem = "sampling on the device (this engine samples on the host)"
        elif not runner.session.feeds_tokens:
            problem = f"a library that exports feed_tokens: {runner.session.lib_path} was compiled before it; recompile"
        elif runner.session.metadata["kv_cache"]["kind"] != "tvmattn":
            # TVM's C++ cache uploads a step's plan on a copy stream of its own, into the buffer the
            # step before may still read: its steps must not run ahead of the GPU
            problem = "tvmattn's KV cache (this library runs TVM's stock cache, whose plan uploads race ahead)"
        elif getattr(runner.cache, "backend", "tir") != "tir":
            # FlashInfer's plan step writes its own workspace, not ordered behind the running step
            problem = f"tvmattn's TIR kernels (this cache runs the {runner.cache.backend} backend)"
        if lookahead and problem:
            raise ValueError(f"lookahead needs {problem}")
        # on the CPU a step's kernels run before its call returns: nothing to overlap
        self.lookahead = not problem and not runner.session.on_cpu if lookahead is None else lookahead
        self._ahead: _Launched | None = None  # the step in flight (lookahead)
        self.runner = runner
        self.page_size = runner.page_size
        self.max_batched_tokens = max_batched_tokens
        self.max_running = max_running
        self.max_queue = max_queue
        self.speculative = options = speculative or SpeculativeOptions("prompt-lookup")
        if (options.mode == "draft-model") != (draft_model is not None):
            raise ValueError("a draft_model is needed by speculative mode 'draft-model' and only by it")
        # what drafts the trees: prompt lookup, or the draft model (see _draft)
        self._drafter = draft_model or PromptLookup(options.draft_len, options.tree_width, options.max_ngram,
                                                    options.min_ngram)
        self._back_off: BackOff | None = None
        if options.back_off:
            lookup = draft_model is None
            self._back_off = BackOff(runner.session.step_costs, PROMPT_LOOKUP_PRIOR if lookup else DRAFT_MODEL_PRIOR,
                                     None if lookup else draft_model.scale)
        self._seq_ids = itertools.count(1)
        self._request_ids = itertools.count(1)
        self.prefix: RadixPrefixCache | None = None
        if prefix_cache == "radix":
            self.prefix = RadixPrefixCache(
                self.page_size, max(runner.max_sequences - max_running, 0), fork=runner.fork, remove=runner.remove,
                free_pages=runner.available_pages, new_id=lambda: next(self._seq_ids))
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self._incoming: collections.deque[Request] = collections.deque()
        self._cancels: set[Request] = set()
        self._lock = threading.Lock()  # guards _incoming, _cancels, _accepting
        self._wake = threading.Condition(self._lock)
        self._step_lock = threading.Lock()  # held through a step (and by inspections)
        self._thread: threading.Thread | None = None
        self._stop = False
        self._accepting = True
        self.error: BaseException | None = None
        # counters (read by /metrics)
        self.steps = 0
        self.preemptions = 0
        self.recomputed_tokens = 0  # tokens of preempted requests prefilled again on readmission
        self.drafted = 0  # speculative draft tokens verified, and accepted
        self.accepted = 0
        self.generated_tokens = 0
        self.prompt_tokens = 0
        # token choices made by the library's sampling kernels, and by the host (every choice in
        # host mode; in device mode the fallback rows: grammar, logprobs, kept logits, verify)
        self.sampled_on_device = self.sampled_on_host = 0
        # decode steps launched before the previous step's tokens were read, and the tokens they
        # appended past a request's end (popped from its sequence, their choices dropped)
        self.lookahead_steps = self.lookahead_dropped = 0
        # lookahead steps whose tokens the library's `sample` chose inside the step's CUDA graph
        self.graph_sampled_steps = 0
        # steps that held prompt chunks, and steps of decode tokens alone: how many, their seconds
        self.prefill_steps = self.decode_steps = 0
        self.prefill_s = self.decode_s = 0.0
        self.snapshot = {"running": 0, "waiting": 0, "pages_free": runner.num_pages, "pages_total": runner.num_pages}
        # timing hooks: on_ttft(seconds), on_inter_token(seconds)
        self.on_ttft: Callable[[float], None] | None = None
        self.on_inter_token: Callable[[float], None] | None = None

    # ------------------------------------------------------------------ submission (any thread)
    def submit(self, prompt: list[int], options: SamplingOptions, *, speculative: bool = False, grammar: Any = None,
               loop: asyncio.AbstractEventLoop | None = None, name: str | None = None, keep_logits: bool = False,
               text: bool = True) -> Request:
        """Queue a request (token ids); raises RequestError when it is refused. Its events
        arrive in request.stream. speculative: draft and verify (the engine's options) where the
        request is greedy (no penalties, grammar or logprobs); name: what errors call it
        (default "request N"); keep_logits: keep the logits row each token was chosen from
        (request.kept); text: detokenize as tokens come (False: the events' text is empty)."""
        runner = self.runner
        if not prompt:
            raise RequestError("the prompt needs at least one token", 400, "prompt")
        vocab = runner.vocab_size
        outside = next((t for t in prompt if not 0 <= t < vocab), None)
        if outside is not None:
            raise RequestError(f"token id {outside} is outside the vocabulary [0, {vocab})", 400, "prompt")
        total = len(prompt) + options.max_tokens
        limit = min(runner.context_window, runner.total_tokens)
        if total > limit:
            what = ("context window" if runner.context_window <= runner.total_tokens else "KV cache pool")
            raise RequestError(f"the prompt ({len(prompt)} tokens) plus max_tokens ({options.max_tokens}) is "
                               f"{total} tokens, over the model's {what} of {limit} tokens", 413, "max_tokens")
        speculative = bool(speculative and options.greedy and not options.penalized and grammar is None
                           and not options.logprobs and runner.has_verify)
        decode = runner.tokenizer.decode if runner.tokenizer is not None and text else (lambda ids: "")
        request_id = next(self._request_ids)
        request = Request(request_id, prompt, options, Sampler(options, vocab), RequestStream(loop),
                          TextStream(decode, options.stop), speculative, grammar, name or f"request {request_id}",
                          keep_logits)
        request.draft_limit = self.speculative.draft_len
        if speculative:
            request.stats = SpeculativeStats(self.speculative.mode)
        with self._lock:
            if not self._accepting:
                raise RequestError("the server is shutting down", 503)
            if len(self._incoming) + len(self.waiting) >= self.max_queue:
                raise RequestError(f"the queue is full ({self.max_queue} waiting requests); retry later", 429)
            self._incoming.append(request)
            self._wake.notify()
        return request

    def cancel(self, request: Request) -> None:
        """Cancel a request (between steps: its sequence is removed and its pages freed)."""
        with self._lock:
            if not request.finished:
                self._cancels.add(request)
                self._wake.notify()

    # ------------------------------------------------------------------ the loop
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="tvmattn-engine", daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        try:
            while True:
                with self._lock:
                    while not self._stop and not self._incoming and not self._cancels \
                            and not self.running and not self.waiting and self._ahead is None:
                        self._wake.wait()
                    if self._stop:
                        return
                self.step()
        except BaseException as err:  # noqa: BLE001 - reported to every request, then re-raised
            self.error = err
            self._fail_all(err)
            raise

    def _fail_all(self, err: BaseException) -> None:
        with self._lock:
            self._accepting = False
            pending = list(self._incoming) + list(self.waiting) + list(self.running)
            self._incoming.clear()
        for request in pending:
            if not request.finished:
                request.finished = True
                request.stream.put(Event("", [], finish_reason="error", output=self._output(request, "error")))

    @property
    def accepting(self) -> bool:
        """New requests are taken (False once draining or failed)."""
        return self._accepting

    def stop_accepting(self) -> None:
        with self._lock:
            self._accepting = False

    def busy(self) -> bool:
        with self._lock:
            return bool(self._incoming or self.waiting or self.running)

    def drain(self, grace_s: float) -> None:
        """Stop accepting; wait up to grace_s for the requests in flight, cancel what is left,
        then stop the loop."""
        self.stop_accepting()
        deadline = time.monotonic() + grace_s
        while self.busy() and time.monotonic() < deadline and self._thread is not None and self._thread.is_alive():
            time.sleep(0.02)
        with self._lock:
            for request in list(self._incoming) + list(self.waiting) + list(self.running):
                self._cancels.add(request)
            self._wake.notify()
        while self.busy() and self._thread is not None and self._thread.is_alive():
            time.sleep(0.01)
        self.shutdown()

    def shutdown(self) -> None:
        with self._lock:
            self._stop = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    # ------------------------------------------------------------------ one step
    def step(self) -> bool:
        """Run one scheduling step (the loop calls it; tests may call it directly when the
        loop is not started). False when there was nothing to do."""
        with self._step_lock:
            self._take_incoming()
            if self._ahead is not None:
                start = time.perf_counter()
                self._advance()
                self.decode_s += time.perf_counter() - start
                self._update_snapshot()
                return True
            if not self.running and not self.waiting:
                self._update_snapshot()
                return False
            start = time.perf_counter()
            decode, chunks = self._schedule()
            while not decode and not chunks and self.running:
                # every running request waits for pages that none of them frees: the newest goes
                # back to the queue (alone in the cache, any admitted request fits)
                self._preempt(self.running[-1])
                decode, chunks = self._schedule()
            if decode or chunks:
                self._run(decode, chunks)
                self.steps += 1
                seconds = time.perf_counter() - start
                if chunks:
                    self.prefill_steps += 1
                    self.prefill_s += seconds
                else:
                    self.decode_steps += 1
                    self.decode_s += seconds
            self._update_snapshot()
            return True

    def _take_incoming(self) -> None:
        with self._lock:
            self.waiting.extend(self._incoming)
            self._incoming.clear()
            cancels, self._cancels = self._cancels, set()
        for request in cancels:
            if request.finished:
                continue
            if request in self.running:
                self.running.remove(request)
            elif request in self.waiting:
                self.waiting.remove(request)
            self._finish(request, "cancelled")

    def _update_snapshot(self) -> None:
        self.snapshot = {"running": len(self.running), "waiting": len(self.waiting),
                         "pages_free": self.runner.available_pages(), "pages_total": self.runner.num_pages}

    # ------------------------------------------------------------------ scheduling
    def _need(self, request: Request, n: int) -> int:
        """Pages a step appending n tokens to the request's sequence takes."""
        ps = self.page_size
        return _pages(request.cached + n, ps) - _pages(request.cached, ps)

    def _ensure_pages(self, needed: int) -> bool:
        if self.runner.available_pages() >= needed:
            return True
        if self.prefix is not None:
            self.prefix.evict(needed)
        return self.runner.available_pages() >= needed

    def _schedule(self) -> tuple[list[_Chunk], list[_Chunk]]:
        """(decode chunks: one token or a draft tree per decoding request, prompt chunks)."""
        budget = self.max_batched_tokens
        while True:
            decoding = [r for r in self.running if r.pending == 1][:budget]
            reserved = sum(self._need(r, 1) for r in decoding)
            if self._ensure_pages(reserved):
                break
            self._preempt(self.running[-1])  # the newest running request
        decode, reserved = self._draft(decoding, reserved)
        budget -= sum(len(c.tokens) for c in decode)
        chunks: list[_Chunk] = []

        def add_chunk(r: Request) -> None:
            nonlocal budget, reserved
            n = min(r.pending, budget)
            pages = self._need(r, n)
            if not self._ensure_pages(reserved + pages):
                n = self._fit(r, n, self.runner.available_pages() - reserved)
                pages = self._need(r, n)
            if n:
                chunks.append(_Chunk(r, r.tokens[r.cached:r.cached + n]))
                budget -= n
                reserved += pages

        for r in list(self.running):  # prompts (or recomputed answers) being prefilled, oldest first
            if budget <= 0:
                break
            if r.pending > 1:
                add_chunk(r)
        while budget > 0 and self.waiting and len(self.running) < self.max_running:
            r = self.waiting[0]
            if not self._admit(r, reserved):
                break
            self.waiting.popleft()
            self.running.append(r)
            self.running.sort(key=lambda q: q.arrival)
            add_chunk(r)
        return decode, chunks

    def _fit(self, request: Request, n: int, free: int) -> int:
        """The most of n tokens the request can append within `free` pages."""
        room = (_pages(request.cached, self.page_size) + max(free, 0)) * self.page_size - request.cached
        return max(min(n, room), 0)

    def _draft(self, decoding: list[Request], reserved: int) -> tuple[list[_Chunk], int]:
        """The decode chunks of a step: each request's last token, under it a draft tree for the
        speculative ones (where the back-off expects drafts to pay and pages are free beside the
        `reserved` ones) -> (chunks, pages reserved)."""
        chunks = [_Chunk(r, [r.tokens[-1]]) for r in decoding]
        speculative = [c for c in chunks if c.request.speculative]
        if not speculative:
            return chunks, reserved
        # the trees of a step (roots included) fit the step's budget and one prefill call
        room = min(self.max_batched_tokens, self.runner.prefill_chunk) // len(chunks) - 1
        limits = [min(c.request.draft_limit, c.request.options.max_tokens - len(c.request.output) - 1, room)
                  for c in speculative]
        back_off = self._back_off
        if isinstance(self._drafter, DraftModel):
            if back_off is not None:
                limits = self._back_off_draft_model(speculative, limits, len(chunks))
            start = time.perf_counter()
            trees = self._drafter.draft([c.request.id for c in speculative], [c.request.tokens for c in speculative],
                                        limits)
            drafted = sum(t.num_drafts for t in trees)
            if drafted:
                self.runner.session.step_costs.observe_draft(drafted, time.perf_counter() - start)
        else:
            trees = [self._drafter.draft(c.request.tokens, limit) for c, limit in zip(speculative, limits)]
            if back_off is not None:
                trees = self._back_off_lookup(speculative, trees, len(chunks))
        for c, tree in zip(speculative, trees):
            if tree.num_drafts == 0:
                continue
            pages = self._need(c.request, len(tree)) - self._need(c.request, 1)
            if pages and not self._ensure_pages(reserved + pages):
                continue  # drafts never preempt anything: this one decodes plainly
            reserved += pages
            c.tokens, c.parents, c.tree = list(tree.tokens), list(tree.parents), tree
        return chunks, reserved

    def _back_off_lookup(self, chunks: list[_Chunk], trees: list[DraftTree], batch: int) -> list[DraftTree]:
        """Prompt lookup's trees with those that do not pay cut back to their roots; a cut draft
        becomes the request's shadow draft (BackOff.shadow)."""
        back_off = self._back_off
        options = {c.request.id: [DraftOption(t.num_drafts, tree_depth(t))] for c, t in zip(chunks, trees)
                   if t.num_drafts}
        plan = back_off.plan(options, batch)
        kept = []
        for c, tree in zip(chunks, trees):
            if tree.num_drafts and c.request.id not in plan:
                back_off.shadow(c.request.id, len(c.request.output), first_chain(tree))
                tree = DraftTree.root(tree.tokens[0])
            kept.append(tree)
        return kept

    def _back_off_draft_model(self, chunks: list[_Chunk], budgets: list[int], batch: int) -> list[int]:
        """The draft model's budgets after the back-off's plan (0: the request does not draft,
        and its evidence fades toward the prior)."""
        back_off, width = self._back_off, self.speculative.tree_width
        options = {}
        for c, budget in zip(chunks, budgets):
            sizes = sorted({min(2 ** i, budget) for i in range(budget.bit_length())} | {budget}) if budget >= 1 else []
            options[c.request.id] = [DraftOption(k, k - min(width, k) + 1) for k in sizes]
        plan = back_off.plan(options, batch)
        for c in chunks:
            if c.request.id not in plan:
                back_off.of(c.request.id).fade()
        return [plan.get(c.request.id, 0) for c in chunks]

    def _admit(self, r: Request, reserved: int) -> bool:
        """Give a waiting request its cache sequence: forked from its longest cached prefix, or
        empty. False (nothing changed) unless the pages for the rest of its tokens, and one
        more, are free beside the `reserved` ones (so that it is not preempted at once)."""
        node, matched = (None, 0)
        if self.prefix is not None:
            node, matched = self.prefix.match(r.tokens, count=False)
            matched = min(matched, len(r.tokens) - 1)
        ps = self.page_size
        wanted = reserved + (1 if matched % ps else 0) + _pages(len(r.tokens), ps) - matched // ps + 1
        if not self._ensure_pages(wanted):
            if self.running:
                return False
            # alone in the cache, any request that was admitted fits (submit checked its size)
        if self.prefix is not None:  # again: the eviction may have taken the node
            node, matched = self.prefix.match(r.tokens, count=r.cached_prompt is None)
            matched = min(matched, len(r.tokens) - 1)
        seq_id = next(self._seq_ids)
        if node is None or matched == 0 or self._fork_refused(node.seq_id, seq_id, matched):
            if matched and self.running and not self._ensure_pages(reserved + _pages(len(r.tokens), ps) + 1):
                return False
            self.runner.add(seq_id)
            matched = 0
        r.seq_id, r.cached = seq_id, matched
        if r.preemptions:
            self.recomputed_tokens += max(len(r.tokens) - 1 - matched, 0)  # the last would be fed anyway
        if r.cached_prompt is None:
            r.cached_prompt = min(matched, r.prompt_len)
            self.prompt_tokens += r.prompt_len
        return True

    def _fork_refused(self, parent: int, child: int, position: int) -> bool:
        """Fork the cache sequence; True (nothing changed) where the cache refuses the position:
        a cache whose sliding-window layers released the tokens its window would read."""
        try:
            self.runner.fork(parent, child, position)
        except ValueError:
            return True
        return False

    def _preempt(self, r: Request) -> None:
        """Free the request's pages and put it back at the head of the queue (recomputed later)."""
        self.running.remove(r)
        self.runner.remove(r.seq_id)
        r.seq_id, r.cached = None, 0
        r.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(r)

    # ------------------------------------------------------------------ running a step
    def _run(self, decode: list[_Chunk], chunks: list[_Chunk]) -> None:
        costs = self.runner.session.step_costs
        if any(c.tree is not None for c in decode) and self._sampler is not None:
            self._verify_on_device(decode)
            decode = []
        elif any(c.tree is not None for c in decode):
            # one batch_verify over every decode chunk (a plain one is a tree of its root)
            start = time.perf_counter()
            node_logits = self.runner.verify([c.request.seq_id for c in decode], [c.tokens for c in decode],
                                             [c.parents if c.parents is not None else [-1] for c in decode])
            costs.observe_verify(sum(len(c.tokens) for c in decode), time.perf_counter() - start)
            for c, rows in zip(decode, node_logits):
                self._check_finite(c.request, rows, "decode")
            accepted = [accept_greedy(c.tree, rows) if c.tree is not None else ([0], None)
                        for c, rows in zip(decode, node_logits)]
            self.runner.commit([c.request.seq_id for c in decode], [path[-1] for path, _ in accepted])
            for c, rows, (path, bonus) in zip(decode, node_logits, accepted):
                r = c.request
                r.cached += len(path)
                if c.tree is None:
                    self._choose(r, rows[0])
                else:
                    self._verified(r, c.tree, rows, path, bonus)
                self._after_decode(r, c.tree)
            decode = []
        step = decode + chunks
        if step and self._sampler is not None:
            self._mixed_on_device(step, len(decode), not chunks)
        elif step:
            start = time.perf_counter()
            logits = self.runner.mixed([c.request.seq_id for c in step], [c.tokens for c in step])
            if not chunks:
                costs.observe_plain(len(step), time.perf_counter() - start)
            for i, (c, row) in enumerate(zip(step, logits)):
                self._check_finite(c.request, row[None], "decode" if i < len(decode) else "prefill")
            for i, (c, row) in enumerate(zip(step, logits)):
                r = c.request
                r.cached += len(c.tokens)
                if r.pending == 0:  # the chunk reached the end of its tokens: choose the next
                    self._choose(r, row)
                if i < len(decode):
                    self._after_decode(r, None)
        fed = []
        for c in chunks:  # a prompt whose prefill completed: share it with later requests
            r = c.request
            if (self.prefix is not None and not r.prompt_recorded and r.cached >= r.prompt_len
                    and r.seq_id is not None):
                r.prompt_recorded = True
                self.prefix.insert(r.tokens[:r.prompt_len], r.seq_id)
            if (r.speculative and not r.draft_fed and r.cached >= r.prompt_len and not r.finished
                    and isinstance(self._drafter, DraftModel)):
                r.draft_fed = True
                fed.append(r)
        if fed:  # the draft model's prefill of the same prompts, in the same step
            self._drafter.prefill([r.id for r in fed], [r.tokens[:r.prompt_len] for r in fed])

    def _choice_inputs(self, r: Request) -> tuple[Sampler | None, np.ndarray | None]:
        """(sampler, grammar mask) of a request about to choose: no sampler when its mask allows
        nothing (it then ends)."""
        mask = r.grammar.allowed() if r.grammar is not None else None
        return (r.sampler if mask is None or mask.any() else None), mask

    def _verify_on_device(self, decode: list[_Chunk]) -> None:
        """The verify step of `_run` with the device sampler: every draft node's argmax and
        each plain request's choice come from the kernels (no node's row is copied unless its
        request keeps logits); the same acceptance and tokens as the host path."""
        start = time.perf_counter()
        samplers, masks, host, spans = [], [], [], []
        for c in decode:
            r, begin = c.request, len(samplers)
            if c.tree is None:  # a plain request decoding in a verify step: its own choice
                sampler, mask = self._choice_inputs(r)
                samplers.append(sampler)
                masks.append(mask)
            else:  # the nodes' argmaxes (greedy rows without a sampler)
                samplers.extend([None] * len(c.tokens))
                masks.extend([None] * len(c.tokens))
            host.extend([r.kept is not None] * len(c.tokens))
            spans.append(range(begin, len(samplers)))
        plan = self._sampler.prepare(samplers, masks, host, self.runner.vocab_size)
        logits = self.runner.verify([c.request.seq_id for c in decode], [c.tokens for c in decode],
                                    [c.parents if c.parents is not None else [-1] for c in decode], on_host=False)
        result = self._sampler.launch(plan, logits).wait()
        self.runner.session.step_costs.observe_verify(len(samplers), time.perf_counter() - start)
        for c, span in zip(decode, spans):
            if any(result.non_finite[i] for i in span):
                self._not_finite(c.request, "decode")
        accepted = [accept_argmax(c.tree, lambda node, span=span: result.greedy[span[node]])
                    if c.tree is not None else ([0], None) for c, span in zip(decode, spans)]
        self.runner.commit([c.request.seq_id for c in decode], [path[-1] for path, _ in accepted])
        for c, span, (path, bonus) in zip(decode, spans, accepted):
            r = c.request
            r.cached += len(path)
            rows = [result.host_rows.get(i) for i in span]
            if c.tree is None:
                if samplers[span[0]] is None:  # no token continues the constrained text
                    self._retire(r, "stop")
                else:
                    if span[0] in result.on_device:
                        self.sampled_on_device += 1
                    else:
                        self.sampled_on_host += 1
                    token, record = result.choices[span[0]]
                    self._emit(r, token, record, rows[0])
            else:
                self._verified(r, c.tree, rows, path, bonus, on_device=span[0] not in result.host_rows)
            self._after_decode(r, c.tree)

    def _mixed_on_device(self, step: list[_Chunk], n_decode: int, plain: bool) -> None:
        """The mixed step of `_run` with the device sampler: the sampling plan made before the
        forward (uniforms drawn, inputs uploaded), the logits left on the device, the kernels
        queued behind the forward and the ids copied back asynchronously; the host samples the
        fallback rows meanwhile, then waits for the ids alone. Same checks, same tokens as the
        host path (tvmattn.sampling's contract)."""
        start = time.perf_counter()
        samplers, masks, host = [], [], []
        for c in step:
            r, sampler, mask = c.request, None, None
            if r.cached + len(c.tokens) == len(r.tokens):  # the chunk reaches the end of its tokens
                sampler, mask = self._choice_inputs(r)
            samplers.append(sampler)
            masks.append(mask)
            host.append(r.kept is not None)  # kept logits: the whole row comes to the host anyway
        plan = self._sampler.prepare(samplers, masks, host, self.runner.vocab_size)
        logits = self.runner.mixed([c.request.seq_id for c in step], [c.tokens for c in step], on_host=False)
        pending = self._sampler.launch(plan, logits)
        requests = [c.request for c in step]
        if plain and self.lookahead and pending.tokens is not None and all(map(self._looks_ahead, requests)):
            for r in requests:
                r.cached += 1
            self._ahead = _Launched(requests, pending)  # read by the next step(), after it launches its own
            return
        result = pending.wait()
        if plain:
            self.runner.session.step_costs.observe_plain(len(step), time.perf_counter() - start)
        for i, c in enumerate(step):
            if result.non_finite[i]:
                self._not_finite(c.request, "decode" if i < n_decode else "prefill")
        self.sampled_on_device += len(result.on_device)
        self.sampled_on_host += len(result.on_host)
        for i, c in enumerate(step):
            r = c.request
            r.cached += len(c.tokens)
            if r.pending == 0:
                if samplers[i] is None:  # no token continues the constrained text
                    self._retire(r, "stop")
                else:
                    token, record = result.choices[i]
                    self._emit(r, token, record, result.host_rows.get(i))
            if i < n_decode:
                self._after_decode(r, None)

    # ------------------------------------------------------------------ lookahead
    def _looks_ahead(self, r: Request) -> bool:
        """Whether the request's next decode step may be launched before its current token is
        read: sampled by the kernels alone (no grammar, logprobs, penalties, kept logits), not
        speculative."""
        return (not r.finished and not r.speculative and r.grammar is None and r.logprobs is None
                and r.kept is None and not r.options.penalized and served_on_device(r.options, None))

    def _advance(self) -> None:
        """Launch the decode step after the one in flight, fed its sampled ids, where nothing
        else waits to be scheduled; then read and emit the in-flight step's tokens."""
        launched, self._ahead = self._ahead, None
        rows = launched.requests
        if (not self.waiting and rows == self.running and all(map(self._looks_ahead, rows))
                and all(len(r.output) + 1 < r.options.max_tokens for r in rows)
                and self._ensure_pages(sum(self._need(r, 1) for r in rows))):
            # where the step is a CUDA graph that ends with `sample`, its parameters go straight
            # to the graph's buffer and the graph chooses the tokens (no launch after it)
            params_at = self.runner.graph_sample_params(len(rows))
            plan = self._sampler.prepare([r.sampler for r in rows], vocab=self.runner.vocab_size, params_at=params_at)
            seq_ids = [r.seq_id for r in rows]
            if params_at is None:
                logits = self.runner.decode_fed(seq_ids, launched.pending.tokens)
                self._ahead = _Launched(rows, self._sampler.launch(plan, logits))
            else:
                logits, sampled = self.runner.decode_fed_sampled(seq_ids, launched.pending.tokens)
                self._ahead = _Launched(rows, self._sampler.launch(plan, logits, sampled=sampled))
                self.graph_sampled_steps += 1
            for r in rows:
                r.unseen = 1
            self.steps += 1
            self.decode_steps += 1
            self.lookahead_steps += 1
        self._complete(launched)

    def _complete(self, launched: _Launched) -> None:
        """Emit the tokens of a decode step left in flight (requests finished meanwhile, by a
        cancellation, get none)."""
        result = launched.pending.wait()
        for i, r in enumerate(launched.requests):
            if result.non_finite[i] and not r.finished:
                self._not_finite(r, "decode")
        for i, r in enumerate(launched.requests):
            if r.finished:
                continue
            token, record = result.choices[i]
            self.sampled_on_device += 1
            if self._emit(r, token, record, None) and r.unseen:
                r.cached += r.unseen  # the lookahead step appended the token just emitted
                r.unseen = 0

    def _check_finite(self, r: Request, rows: np.ndarray, kind: str) -> None:
        """GenerateError naming the request and its step (its tokens so far) when a row of
        logits is not finite."""
        if not np.isfinite(rows).all():
            self._not_finite(r, kind)

    def _not_finite(self, r: Request, kind: str) -> None:
        raise GenerateError(f"logits are not finite at step {len(r.output)} ({kind}) of {r.name}: the weights "
                            f"hold NaN or inf, or the library is broken; check the weights and recompile")

    def _verified(self, r: Request, tree: DraftTree, rows, path: list[int], bonus: int,
                  on_device: bool = False) -> None:
        """Emit a verified tree's accepted drafts and its bonus token; count them (rows: the
        nodes' logits, or None each where the device chose and nobody keeps them; on_device:
        the argmaxes came from the kernels)."""
        accepted, depth = len(path) - 1, tree_depth(tree)
        self.drafted += tree.num_drafts
        self.accepted += accepted
        r.stats.verify_steps += 1
        r.stats.drafted += tree.num_drafts
        r.stats.accepted += accepted
        if self.speculative.adaptive:
            r.draft_limit = next_draft_len(r.draft_limit, accepted, depth, self.speculative.draft_len)
        if self._back_off is not None:
            self._back_off.verified(r.id, accepted, depth)
        if on_device:  # the accepted drafts and the bonus: argmaxes of the nodes' rows
            self.sampled_on_device += len(path)
        else:
            self.sampled_on_host += len(path)
        chosen = [(tree.tokens[node], rows[parent]) for parent, node in zip(path, path[1:])]
        for token, row in chosen + [(bonus, rows[path[-1]])]:
            if not self._emit(r, token, None, row):
                break

    def _after_decode(self, r: Request, tree: DraftTree | None) -> None:
        """A speculative request's count of a plain step, and its shadow draft judged by the
        tokens it now has."""
        if not r.speculative:
            return
        if tree is None:
            r.stats.plain_steps += 1
        if self._back_off is not None:
            shadow = self._back_off.check_shadow(r.id, r.output)
            if shadow is not None and self.speculative.adaptive:
                r.draft_limit = next_draft_len(r.draft_limit, shadow[0], shadow[1], self.speculative.draft_len)

    def _choose(self, r: Request, row: np.ndarray) -> None:
        mask = r.grammar.allowed() if r.grammar is not None else None
        if mask is not None and not mask.any():  # no token continues the constrained text
            self._retire(r, "stop")
            return
        token, record = r.sampler.choose(row, mask)
        self.sampled_on_host += 1
        self._emit(r, token, record, row)

    def _emit(self, r: Request, token: int, record: TokenLogprob | None, row: np.ndarray | None) -> bool:
        """Add a chosen token (from the logits `row`; None where the device chose it and the
        request keeps no logits) to the request; False when the request finished."""
        if r.finished:
            return False
        now = time.perf_counter()
        stops = r.options.stop_token_ids
        if token in stops or (not r.options.ignore_eos and token in self.runner.stop_ids):
            self._retire(r, "stop")
            return False
        if r.grammar is not None:
            try:
                r.grammar.accept(token)
            except ValueError:  # the mask allowed it, so this is a recognizer bug: end this request only
                self._retire(r, "error")
                return False
        r.tokens.append(token)
        r.sampler.accept(token)
        if r.logprobs is not None and record is not None:
            r.logprobs.append(record)
        if r.kept is not None:
            r.kept.append(np.array(row, dtype=np.float32))
        self.generated_tokens += 1
        if r.first_token is None:
            r.first_token = now
            if self.on_ttft is not None:
                self.on_ttft(now - r.arrival)
        elif self.on_inter_token is not None:
            self.on_inter_token(now - r.last_token)
        r.last_token = now
        piece = r.text.push([token])
        event = Event(piece, [token], [record] if record is not None else None)
        if r.text.stopped:
            r.stream.put(event)
            self._retire(r, "stop")
            return False
        if len(r.output) >= r.options.max_tokens:
            r.stream.put(event)
            self._retire(r, "length")
            return False
        r.stream.put(event)
        if r.grammar is not None and r.grammar.done:  # the constrained text is complete
            self._retire(r, "stop")
            return False
        return True

    def _retire(self, r: Request, reason: str) -> None:
        if r in self.running:
            self.running.remove(r)
        self._finish(r, reason)

    def _finish(self, r: Request, reason: str) -> None:
        """Release the request's sequence (its pages stay with the prefix cache as far as it
        records them) and send the last event."""
        if r.seq_id is not None:
            shareable = True
            if r.unseen:  # a lookahead step appended a token past the request's end
                self.lookahead_dropped += r.unseen
                try:
                    self.runner.popn(r.seq_id, r.unseen)
                except ValueError:  # the cache refuses (sliding window): the sequence is not r.tokens' prefix
                    shareable = False
                r.unseen = 0
            if self.prefix is not None and reason != "cancelled" and shareable:
                self.prefix.insert(r.tokens[:r.cached], r.seq_id)
            self.runner.remove(r.seq_id)
            r.seq_id = None
        if isinstance(self._drafter, DraftModel):
            self._drafter.release(r.id)
        if self._back_off is not None:
            self._back_off.forget(r.id)
        r.finished = True
        piece = r.text.flush()
        r.stream.put(Event(piece, [], finish_reason=reason, output=self._output(r, reason)))

    def _output(self, r: Request, reason: str) -> RequestOutput:
        now = time.perf_counter()
        return RequestOutput(r.id, r.prompt_len, r.output, r.text.answer(), reason, r.cached_prompt or 0,
                             None if r.first_token is None else r.first_token - r.arrival, now - r.arrival,
                             r.preemptions, r.logprobs)

    # ------------------------------------------------------------------ inspection
    def held_pages(self) -> tuple[int, int]:
        """(pages in use, pages the prefix cache's sequences hold): equal when no request runs."""
        with self._step_lock:
            cache = self.runner.cache
            used = self.runner.num_pages - self.runner.available_pages()
            held: set[int] = set()
            for seq_id in (self.prefix.sequence_ids() if self.prefix is not None else []):
                held.update(cache.sequence_state(seq_id)["pages"])
            return used, len(held)

    def memory_report(self) -> dict | None:
        """The cache's memory_report() between two steps (tvmattn's cache; None for TVM's)."""
        with self._step_lock:
            report = getattr(self.runner.cache, "memory_report", None)
            return report() if report is not None else None

    def cache_sequences(self) -> list[int]:
        with self._step_lock:
            return list(self.runner.cache.sequence_ids())

    def clear_prefix_cache(self) -> None:
        with self._step_lock:
            if self.prefix is not None:
                self.prefix.clear()
