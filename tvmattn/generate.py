"""Text generation with a compiled model library (tvmattn.build): the public Python API and what
`python -m tvmattn generate` runs.

`Generator(lib_path).generate(prompts, ...)` returns a `Generation` (texts, token ids, timings);
`generate_tokens` does the same from token ids. Greedy when temperature == 0, otherwise
temperature + top-p (nucleus) sampling, each prompt from its own generator seeded from
(seed, prompt index).

A Generator holds no decode loop of its own. Its library is a `tvmattn.session.ModelSession`;
each call sizes a KV cache to the call (`ModelRunner`, kept while later calls fit), submits its
prompts to a fresh serving engine (tvmattn/serve/engine.py: chunked prefill, continuous
batching, speculative decoding; no prefix cache, as calls share nothing) and drives it with
`engine.step()` in the caller's thread until every answer is complete, handing tokens and text
to the callbacks between steps.

Speculative (greedy) decoding: `generate_tokens(..., speculative=SpeculativeOptions(...))`
drafts token trees (prompt lookup, or a draft library: tvmattn.serve.runner.DraftModel) and
verifies them in the engine's steps (tvmattn/speculative.py describes the trees, the acceptance
and the back-off that decodes plainly where drafts do not pay, weighed on the session's
measured `step_costs`). Its tokens are those of plain greedy decoding. Temperature > 0 is
refused (no speculative sampling).

The bundle's files are read and checked by tvmattn/bundle.py; every problem with them, and
every bad argument, is a GenerateError naming it.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from pathlib import Path
from typing import Any, Callable

import numpy as np

from .calibrate import kv_scales_shape
from .sampling import SamplingOptions
from .serve.engine import SAMPLING_MODES, Engine, Event, RequestError
from .serve.runner import DraftModel, ModelRunner
from .session import GenerateError, ModelSession, no_cyclic_gc
from .speculative import SpeculativeOptions, SpeculativeStats

# GenerateError and no_cyclic_gc are this module's API too (the command line and scripts import
# them from here); they live in tvmattn.session, below the engine
__all__ = ["Generation", "Generator", "GenerateError", "no_cyclic_gc", "render_chat", "utf8_problem"]


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
    """What a call returns. The engine's steps are timed whole: prefill_s sums the steps that
    held prompt tokens (a step may also carry the decode tokens of answers already started, when
    the prompts exceed one step's budget), decode_s and decode_steps the steps of decode tokens
    (or draft trees) alone."""

    texts: list[str]  # generate: the answers' text; generate_tokens: empty
    tokens: list[list[int]]  # generated token ids per prompt (stop token excluded)
    prompt_tokens: list[int]  # prompt length per prompt
    prefill_s: float
    decode_s: float
    decode_steps: int
    # with keep_logits: per prompt, the float32 logits [len(tokens), vocab] each token was chosen from
    logits: list[np.ndarray] | None = None
    # speculative decoding only: trees verified (one per sequence and step), drafts fed, drafts accepted
    speculative: SpeculativeStats | None = None
    # token choices made by the library's sampling kernels and by the host (Generator.sampling)
    sampled_on_device: int = 0
    sampled_on_host: int = 0

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


def _cache_tokens(settings: dict, needed: int, sequences: int) -> int:
    """Tokens of a KV cache for `needed` tokens over `sequences` sequences of a library with these
    settings: whole pages, and a page more per sequence (its last page is partly filled), at
    least 256 tokens in all; GenerateError when they exceed its capacity."""
    capacity = settings["context_window"] * settings["max_batch_size"]
    if needed > capacity:
        raise GenerateError(f"{needed} tokens do not fit the library's KV capacity ({settings['max_batch_size']} x "
                            f"context window {settings['context_window']})")
    page = settings["page_size"]
    return min(max(-(-needed // page) * page + sequences * page, 256), capacity)


class Generator:
    """A loaded library bundle (`ModelSession`: VM, weights, tokenizer) that answers prompts
    through the serving engine (module docstring).

    Before loading anything, OUT.runtime.json is checked field by field, and OUT.so and
    OUT.params.npz against the size and sha256 it recorded ("files"); any broken file is a
    GenerateError naming it and the problem (tvmattn/bundle.py).
    """

    def __init__(self, lib_path: str | Path, cuda_graph: bool = True, sampling: str = "auto"):
        """cuda_graph: on CUDA, replay decode steps as CUDA graphs (one per batch bucket,
        tvmattn.runtime.graphs) where the library exports `decode_step` and runs tvmattn's
        cache with its TIR kernels; otherwise (or False) every step runs eagerly. sampling:
        "device" (the library's sampling kernels; the host reads back token ids), "host"
        (tvmattn.sampling on copied logits) or "auto" (device on an accelerator where the
        library has the kernels, host on the CPU); the same tokens either way (see tvmattn.sampling)."""
        if sampling not in SAMPLING_MODES:
            raise GenerateError(f"sampling must be one of {', '.join(SAMPLING_MODES)}, got {sampling!r}")
        self.session = ModelSession(lib_path, cuda_graph=cuda_graph)
        self.sampling = sampling
        if sampling == "device" and self.session.device_sampler() is None:
            raise GenerateError(f"sampling='device': {lib_path} has no sampling kernels that flag non-finite "
                                f"logits (compiled before them); recompile it, or sample on the host")
        s = self.session
        self.lib_path, self.device = s.lib_path, s.device
        self.runtime, self.metadata, self.settings, self.tokenizer = s.runtime, s.metadata, s.settings, s.tokenizer
        self.prefill_chunk = s.prefill_chunk  # tokens per prefill call (and engine step)
        self.stop_ids = set(s.stop_ids)  # tokens that end an answer (a test may clear them)
        self.runner: ModelRunner | None = None  # the KV cache of the last call, kept while calls fit it
        self._drafts: dict[Path, ModelSession] = {}

    @property
    def step_costs(self):
        """The session's measured step costs (what the speculative back-off weighs)."""
        return self.session.step_costs

    @step_costs.setter
    def step_costs(self, costs) -> None:
        self.session.step_costs = costs

    @property
    def uses_cuda_graph(self) -> bool:
        return self.session.uses_cuda_graph

    @property
    def sampling_in_use(self) -> str:
        """"device" or "host": who chooses the tokens of this generator's calls (sampling
        "auto" resolved against the library)."""
        chosen = self.session.auto_sampler() if self.sampling == "auto" else self.session.device_sampler()
        if self.sampling == "host" or chosen is None:
            return "host"
        return "device"

    def sibling(self) -> "Generator":
        """The same loaded library with a KV cache of its own (its steps run eagerly)."""
        other = copy.copy(self)
        other.session, other.runner, other._drafts = self.session.sibling(), None, {}
        other.stop_ids = set(self.stop_ids)
        return other

    @property
    def kv_scales(self):
        """FP8 KV scales [layers, 2, kv_heads] for the caches of later calls (None: 1.0 each;
        `tvmattn.calibrate_kv_scales`). Setting them drops the current cache."""
        return self.session.kv_scales

    @kv_scales.setter
    def kv_scales(self, scales) -> None:
        """Checked here (GenerateError naming kv_scales, nothing changed) rather than when the
        next call's cache is made, which would leave the generator without a cache."""
        if scales is not None and "kv_cache" in self.session.metadata:
            shape = kv_scales_shape(self.session.metadata["kv_cache"])
            try:
                array = np.broadcast_to(np.asarray(scales, dtype=np.float64), shape).astype(np.float32)
            except (ValueError, TypeError):
                raise GenerateError(f"kv_scales must broadcast to {list(shape)}, got shape {np.shape(scales)}") from None
            if not (np.isfinite(array).all() and (array > 0).all()):
                raise GenerateError("kv_scales must be finite and positive")
            scales = array
        self.session.kv_scales, self.runner = scales, None

    # ------------------------------------------------------------------ token level
    def _runner_for(self, needed: int, sequences: int) -> ModelRunner:
        """A KV cache for `needed` tokens over `sequences` sequences (`_cache_tokens`), re-created
        only when a call needs more than the current one holds."""
        tokens = _cache_tokens(self.settings, needed, sequences)
        if self.runner is None or tokens > self.runner.total_tokens:
            self.runner = None
            self.runner = ModelRunner(session=self.session, max_total_tokens=tokens,
                                      max_sequences=self.settings["max_batch_size"])
        return self.runner

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

        def on_event(index: int, event: Event) -> None:
            if on_token is not None:
                for token in event.tokens:
                    on_token(index, token)
            if event.finish_reason is not None and on_finish is not None:
                on_finish(index)

        return self._run([[int(t) for t in p] for p in prompts], max_new_tokens, temperature, top_p, seed,
                         speculative, keep_logits, False, on_event)

    @no_cyclic_gc()
    def _run(self, prompts: list[list[int]], max_new_tokens: int, temperature: float, top_p: float, seed: int,
             speculative: SpeculativeOptions | None, keep_logits: bool, text: bool,
             on_event: Callable[[int, Event], None]) -> Generation:
        """Check the arguments, submit the prompts to an engine over this call's cache and step it
        until every answer is complete; on_event(prompt index, event) between steps."""
        if len(prompts) > self.settings["max_batch_size"]:
            raise GenerateError(f"{len(prompts)} prompts exceed the library's max batch size "
                                f"{self.settings['max_batch_size']}")
        _check_sampling(max_new_tokens, temperature, top_p, seed)
        if speculative is not None:
            self._check_speculative(speculative, temperature)
        vocab = self.session.vocab_size
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
        runner = self._runner_for(sum(len(p) for p in prompts) + len(prompts) * (max_new_tokens + tree), len(prompts))
        draft = None
        if speculative is not None and speculative.mode == "draft-model":
            draft = self._draft_model(speculative, prompts, max_new_tokens)
        engine = Engine(runner, max_batched_tokens=min(self.prefill_chunk, runner.prefill_chunk),
                        max_running=len(prompts), max_queue=len(prompts), prefix_cache="off",
                        speculative=speculative, draft_model=draft, sampling=self.sampling)
        stops = tuple(sorted(self.stop_ids))
        requests = []
        try:
            for index, prompt in enumerate(prompts):
                # each prompt samples from its own generator: its answer does not depend on the others
                options = SamplingOptions(temperature=float(temperature), top_p=float(top_p),
                                          seed=int(np.random.SeedSequence(int(seed), spawn_key=(index,))
                                                   .generate_state(1, np.uint64)[0]),
                                          max_tokens=int(max_new_tokens), stop_token_ids=stops, ignore_eos=True)
                requests.append(engine.submit(prompt, options, speculative=speculative is not None,
                                              name=f"prompt {index}", keep_logits=keep_logits, text=text))
            while engine.step():
                for index, request in enumerate(requests):
                    for event in request.stream.ready():
                        on_event(index, event)
        except RequestError as err:  # the checks above should have caught it
            self.runner = None
            raise GenerateError(str(err)) from None
        except BaseException:
            self.runner = None  # a step that failed may leave sequences in the cache: the next call makes another
            raise
        outputs = [r.stream.output for r in requests]
        stats = None
        if speculative is not None:
            stats = SpeculativeStats(speculative.mode)
            for r in requests:
                for field in ("verify_steps", "drafted", "accepted", "plain_steps"):
                    setattr(stats, field, getattr(stats, field) + getattr(r.stats, field))
        return Generation([], [o.tokens for o in outputs],
                          [len(p) for p in prompts], engine.prefill_s, engine.decode_s, engine.decode_steps,
                          [np.stack(r.kept) if r.kept else np.zeros((0, 0), np.float32) for r in requests]
                          if keep_logits else None, stats, engine.sampled_on_device, engine.sampled_on_host)

    # ------------------------------------------------------------------ speculative decoding
    def _check_speculative(self, options: SpeculativeOptions, temperature: float) -> None:
        if temperature > 0:
            raise GenerateError(f"speculative decoding is greedy only: temperature must be 0, got {temperature} "
                                f"(speculative sampling is not implemented)")
        if not self.session.has_verify:
            raise GenerateError(f"{self.lib_path} has no batch_verify function (compiled before speculative "
                                f"decoding existed); recompile it")
        if options.mode == "draft-model":
            self._draft_session(options)

    def _draft_session(self, options: SpeculativeOptions) -> ModelSession:
        """The drafting library of options.draft_lib (loaded once; this library itself when it
        is the same file), checked to share this one's vocabulary."""
        path = Path(options.draft_lib)
        if path.resolve() == self.lib_path.resolve():
            return self.session.sibling()
        key = path.resolve()
        if key not in self._drafts:
            try:
                draft = ModelSession(path, cuda_graph=False)  # drafts run eagerly
            except GenerateError as err:
                raise GenerateError(f"--draft-lib: {err}") from None
            ours, theirs = self.session.vocab_size, draft.vocab_size
            if ours != theirs or (self.tokenizer is not None and draft.tokenizer is not None
                                  and self.tokenizer.get_vocab() != draft.tokenizer.get_vocab()):
                raise GenerateError(f"--draft-lib {str(path)!r}: its vocabulary ({theirs} tokens) differs from that "
                                    f"of {self.lib_path} ({ours}); the draft model needs the same tokenizer")
            self._drafts[key] = draft
        return self._drafts[key]

    def _draft_model(self, options: SpeculativeOptions, prompts: list[list[int]], max_new_tokens: int) -> DraftModel:
        """The draft model of a call, its cache sized to the call's prompts, answers and drafts."""
        session = self._draft_session(options)
        settings = session.settings
        longest = max(len(p) for p in prompts) + max_new_tokens + options.draft_len
        if longest > settings["context_window"]:
            raise GenerateError(f"--draft-lib {str(session.lib_path)!r}: {longest} tokens (prompt, answer and "
                                f"draft) exceed its context window {settings['context_window']}")
        if len(prompts) > settings["max_batch_size"]:
            raise GenerateError(f"--draft-lib {str(session.lib_path)!r}: {len(prompts)} prompts exceed its max "
                                f"batch size {settings['max_batch_size']}")
        needed = sum(len(p) for p in prompts) + len(prompts) * (max_new_tokens + options.draft_len)
        return DraftModel(session, options.tree_width, _cache_tokens(settings, needed, len(prompts)),
                          settings["max_batch_size"],
                          session.weight_bytes / self.session.weight_bytes)

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

        def on_event(index: int, event: Event) -> None:
            if stream is not None and event.text:  # pieces never end inside a UTF-8 sequence
                stream(event.text)
            if event.output is not None and on_answer is not None:
                on_answer(index, self.tokenizer.decode(event.output.tokens))

        # the engine detokenizes as tokens come only for a stream
        result = self._run(ids, max_new_tokens, temperature, top_p, seed, speculative, False, stream is not None,
                           on_event)
        result.texts = [self.tokenizer.decode(t) for t in result.tokens]
        return result
