"""Text generation with a compiled model library (tvmattn.build): load OUT.so into the Relax VM,
load OUT.params.npz, create the paged KV cache, tokenize, prefill then decode.

`Generator(lib_path).generate(prompts, ...)` returns a `Generation` (texts, token ids, timings);
one prompt goes through `prefill` / `decode`, several through `batch_prefill` / `batch_decode`.
Greedy when temperature == 0, otherwise temperature + top-p (nucleus) sampling with a seeded
numpy generator. `python -m tvmattn generate` is the command line over it.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Callable

import numpy as np
import tvm
from tvm import relax
from tvm.runtime import ShapeTuple

from .runtime import ffi as _ffi  # noqa: F401  - registers tvmattn.* before the library is loaded
from .build import PARAMS_SUFFIX, RUNTIME_SUFFIX, sidecar


class GenerateError(ValueError):
    """A missing or inconsistent library bundle, or a bad generation argument."""


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


def render_chat(template: str, prompt: str) -> str:
    """The chat template applied to one user message, with the assistant generation prompt."""
    import jinja2

    env = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
    return env.from_string(template).render(messages=[{"role": "user", "content": prompt}],
                                            add_generation_prompt=True, bos_token="", eos_token="")


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


class Generator:
    """A loaded library bundle: VM, weights, tokenizer and KV cache."""

    def __init__(self, lib_path: str | Path):
        lib_path = Path(lib_path)
        runtime_file = sidecar(lib_path, RUNTIME_SUFFIX)
        for path in (lib_path, runtime_file):
            if not path.is_file():
                raise GenerateError(f"--lib {str(lib_path)!r}: {path} is missing (build it with scripts/compile.py)")
        self.runtime = json.loads(runtime_file.read_text())
        self.metadata = self.runtime["metadata"]
        self.settings = self.runtime["settings"]
        params_file = sidecar(lib_path, PARAMS_SUFFIX)
        if self.runtime.get("params_file") is None or not params_file.is_file():
            raise GenerateError(f"--lib {str(lib_path)!r}: no weights ({params_file} is missing); "
                                f"compile from a .gguf file or a folder with safetensors")
        target = self.metadata["build_options"]["target"]
        self.device = tvm.cuda(0) if target.startswith("cuda") else tvm.cpu()
        if not self.device.exist:
            raise GenerateError(f"--lib {str(lib_path)!r} was built for {target}, and no such device is present")
        self.vm = relax.VirtualMachine(tvm.runtime.load_module(str(lib_path)), self.device)
        with np.load(params_file) as stored:
            params = [stored[f"p{i}"] for i in range(len(self.metadata["params"]))]
        for value, param in zip(params, self.metadata["params"]):
            if list(value.shape) != param["shape"]:
                raise GenerateError(f"{params_file}: parameter {param['name']!r} has shape {list(value.shape)}, "
                                    f"the library needs {param['shape']}")
        self.params = [tvm.runtime.tensor(p, device=self.device) for p in params]
        self.tokenizer = None
        if self.runtime.get("tokenizer"):
            import tokenizers

            self.tokenizer = tokenizers.Tokenizer.from_str(self.runtime["tokenizer"])
        self.stop_ids = set(self.runtime.get("stop_token_ids") or [])
        kind = self.metadata["kv_cache"]["kind"]
        prefix = "tvmattn." if kind == "tvmattn" else "vm.builtin."
        self._host = {name: tvm.get_global_func(prefix + name) for name in
                      ("kv_state_add_sequence", "kv_state_remove_sequence", "kv_state_begin_forward",
                       "kv_state_end_forward")}
        self.cache = None
        self._capacity = 0

    # ------------------------------------------------------------------ token level
    def _ensure_cache(self, needed: int) -> None:
        capacity = self.settings["context_window"] * self.settings["max_batch_size"]
        if needed > capacity:
            raise GenerateError(f"{needed} tokens do not fit the library's KV capacity "
                                f"({self.settings['max_batch_size']} x context window {self.settings['context_window']})")
        page = self.settings["page_size"]
        needed = max(-(-needed // page) * page, 256)
        if self.cache is None or needed > self._capacity:
            self.cache = None
            self.cache = self.vm["create_paged_kv_cache"](
                ShapeTuple([self.settings["max_batch_size"]]), ShapeTuple([min(needed * 2, capacity)]),
                ShapeTuple([self.settings["prefill_chunk"]]), ShapeTuple([page]), ShapeTuple([0]))
            self._capacity = min(needed * 2, capacity)

    def _embed(self, tokens: list[int]) -> np.ndarray:
        ids = tvm.runtime.tensor(np.array(tokens, dtype=np.int32), device=self.device)
        return self.vm["embed"](ids, self.params).numpy()

    def _forward(self, function: str, seq_ids: list[int], lengths: list[int], embeds: np.ndarray, *extra):
        self._host["kv_state_begin_forward"](self.cache, ShapeTuple(seq_ids), ShapeTuple(lengths))
        logits, _ = self.vm[function](tvm.runtime.tensor(embeds, device=self.device), *extra, self.cache,
                                      self.params)
        self._host["kv_state_end_forward"](self.cache)
        return logits.numpy()

    def _prefill(self, seq_ids: list[int], prompts: list[list[int]]) -> np.ndarray:
        """-> [len(prompts), vocab] logits of each prompt's last token."""
        chunk = self.settings["prefill_chunk"]
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

    def generate_tokens(self, prompts: list[list[int]], max_new_tokens: int = 32, temperature: float = 0.0,
                        top_p: float = 1.0, seed: int = 0,
                        on_token: Callable[[int, int], None] | None = None, keep_logits: bool = False,
                        on_finish: Callable[[int], None] | None = None) -> Generation:
        """Generate from token-id prompts; on_token(prompt index, token) is called per new token,
        on_finish(prompt index) when that prompt's answer is complete;
        keep_logits: also return the logits each token was chosen from (Generation.logits)."""
        if not prompts or any(len(p) == 0 for p in prompts):
            raise GenerateError("every prompt needs at least one token")
        if len(prompts) > self.settings["max_batch_size"]:
            raise GenerateError(f"{len(prompts)} prompts exceed the library's max batch size "
                                f"{self.settings['max_batch_size']}")
        if max_new_tokens < 1:
            raise GenerateError(f"--max-new-tokens must be at least 1, got {max_new_tokens}")
        if temperature < 0 or not 0 < top_p <= 1:
            raise GenerateError(f"need temperature >= 0 and 0 < top_p <= 1, got {temperature}, {top_p}")
        longest = max(len(p) for p in prompts) + max_new_tokens
        if longest > self.settings["context_window"]:
            raise GenerateError(f"prompt + {max_new_tokens} new tokens = {longest} tokens exceed the context "
                                f"window {self.settings['context_window']}")
        self._ensure_cache(sum(len(p) for p in prompts) + len(prompts) * max_new_tokens)
        rng = np.random.default_rng(seed)
        seq_ids = list(range(len(prompts)))
        for seq_id in seq_ids:
            self._host["kv_state_add_sequence"](self.cache, seq_id)
        generated: list[list[int]] = [[] for _ in prompts]
        kept: list[list[np.ndarray]] = [[] for _ in prompts]
        try:
            start = time.perf_counter()
            logits = self._prefill(seq_ids, prompts)
            prefill_s = time.perf_counter() - start
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
                embeds = self._embed(tokens)[:, None, :]
                if len(active) == 1 and len(prompts) == 1:
                    logits = self._forward("decode", active, [1], embeds)[:, 0]
                else:
                    logits = self._forward("batch_decode", active, [1] * len(active), embeds)[:, 0]
                steps += 1
            decode_s = time.perf_counter() - start
        finally:
            for seq_id in seq_ids:
                self._host["kv_state_remove_sequence"](self.cache, seq_id)
        return Generation([], generated, [len(p) for p in prompts], prefill_s, decode_s, steps,
                          [np.stack(rows) if rows else np.zeros((0, 0), np.float32) for rows in kept]
                          if keep_logits else None)

    # ------------------------------------------------------------------ text level
    def encode(self, prompt: str, chat: bool = True) -> list[int]:
        if self.tokenizer is None:
            raise GenerateError("the library bundle has no tokenizer (compile from a .gguf file)")
        template = self.runtime.get("chat_template")
        if chat and template:
            return self.tokenizer.encode(render_chat(template, prompt), add_special_tokens=False).ids
        return self.tokenizer.encode(prompt).ids

    def generate(self, prompts: list[str], max_new_tokens: int = 32, temperature: float = 0.0, top_p: float = 1.0,
                 seed: int = 0, chat: bool = True, stream: Callable[[str], None] | None = None,
                 on_answer: Callable[[int, str], None] | None = None) -> Generation:
        """Generate from text prompts.

        stream(text piece): with one prompt, called as its text arrives (a piece never ends inside
        a UTF-8 sequence); on_answer(prompt index, text): called once per prompt as soon as its
        answer is complete (answers of a batch arrive in the order they finish).
        """
        if stream is not None and len(prompts) != 1:
            raise GenerateError(f"stream needs exactly one prompt, got {len(prompts)}; use on_answer for a batch")
        ids = [self.encode(p, chat) for p in prompts]
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
                                      on_finish=on_finish)
        result.texts = [self.tokenizer.decode(t) for t in result.tokens]
        if stream is not None and result.texts[0] != shown[0]:
            stream(result.texts[0][len(shown[0]):])
        return result
