"""JSON-constrained sampling (response_format json_object / json_schema) by xgrammar.

`JsonGrammars` belongs to a server: xgrammar's view of the model's vocabulary (a TokenizerInfo
built from our `tokenizers.Tokenizer`) and a GrammarCompiler, whose cache keeps each schema's
compiled grammar. `compile(schema)` turns a JSON Schema (or None: any JSON object) into a
compiled grammar; `matcher(compiled)` starts one request's `JsonGrammar`, the object the engine
drives: `allowed()` is the token mask before each sampled token, `accept(token)` advances it,
`done` says the JSON text is complete. Speculative decoding is off for such requests (the engine
never drafts for them), so a matcher never rolls back.

The text is JSON with xgrammar's default separators (", " and ": ") and no other whitespace, so a
model cannot spin on blanks. Full JSON Schema as xgrammar supports it: anyOf / oneOf, $ref and
$defs, pattern, enum and const, numeric and length bounds, ...; with its strict mode (an object
holds only the properties its schema names, as OpenAI's strict structured outputs).
"""

from __future__ import annotations

import re
import threading
from typing import Any

import numpy as np

_LOG_PREFIX = re.compile(r"^\s*\[[0-9:]+\]\s*\S+:\d+:\s*")


class GrammarError(ValueError):
    """A schema xgrammar cannot compile, or xgrammar missing (the message says which)."""


def _xgrammar():
    try:
        import xgrammar
    except ImportError as err:
        raise GrammarError(f"response_format json_object / json_schema needs xgrammar, which cannot be imported "
                           f"here ({err}); pip install 'tvmattn[serve]'") from None
    return xgrammar


def _vocabulary(tokenizer, vocab_size: int) -> list[str]:
    """Token strings in the tokenizer's own encoding, indexed by id ("" for ids it lacks)."""
    encoded = [""] * vocab_size
    for token, index in tokenizer.get_vocab(with_added_tokens=True).items():
        if 0 <= index < vocab_size:
            encoded[index] = token
    return encoded


class JsonGrammars:
    """xgrammar's compiler over a model's vocabulary. tokenizer: a `tokenizers.Tokenizer`;
    vocab_size: the model's logits width (>= the tokenizer's ids); stop_ids: its stop tokens."""

    def __init__(self, tokenizer, vocab_size: int, stop_ids=()):
        if tokenizer is None:
            raise GrammarError("this model has no tokenizer: JSON-constrained output needs one")
        xgr = _xgrammar()
        self.vocab_size = vocab_size
        stops = sorted(int(t) for t in stop_ids if 0 <= int(t) < vocab_size) or None
        # the vocabulary type (byte-level BPE, byte fallback, raw) and the prefix space come from
        # the tokenizer's serialization, as xgrammar reads a Hugging Face fast tokenizer's
        from transformers import PreTrainedTokenizerFast

        fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer)
        info = xgr.TokenizerInfo.from_huggingface(fast, vocab_size=vocab_size, stop_token_ids=stops)
        self._xgr = xgr
        self.info = info
        # tokens holding a raw control character (bytes below 0x20): compact JSON never has one
        # (strings escape them), but xgrammar's length-bounded strings admit them
        self.never = np.array([any(b < 0x20 for b in text) for text in info.decoded_vocab[:vocab_size]]
                              + [False] * max(vocab_size - len(info.decoded_vocab), 0), dtype=bool)
        self.compiler = xgr.GrammarCompiler(info, max_threads=1)
        self._lock = threading.Lock()  # a compiler call at a time (requests compile from worker threads)

    def compile(self, schema: dict | None):
        """The compiled grammar of a JSON Schema (a dict), or of any JSON object (None)."""
        if schema is not None and not isinstance(schema, dict):
            raise GrammarError(f"the schema must be a JSON object, got {type(schema).__name__}")
        import json

        text = json.dumps({"type": "object"} if schema is None else schema)
        try:
            with self._lock:
                return self.compiler.compile_json_schema(text, any_whitespace=False,
                                                         strict_mode=schema is not None)
        except (RuntimeError, ValueError, TypeError) as err:
            message = _LOG_PREFIX.sub("", str(err)).strip().splitlines()
            raise GrammarError(f"the schema cannot be compiled: {message[0] if message else type(err).__name__}") \
                from None

    def matcher(self, compiled) -> "JsonGrammar":
        return JsonGrammar(self._xgr.GrammarMatcher(compiled, terminate_without_stop_token=True), self.vocab_size,
                           self.never)


class JsonGrammar:
    """One request's constrained text: allowed() -> bool [vocab] mask of the tokens that keep it
    a prefix of the grammar's language; accept(token) advances it (ValueError for a token the
    mask refused); done: the text is complete."""

    def __init__(self, matcher: Any, vocab_size: int, never: np.ndarray | None = None):
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.never = never  # tokens refused whatever the grammar says
        self._bitmask = np.zeros((1, -(-vocab_size // 32)), np.int32)

    @property
    def done(self) -> bool:
        return bool(self.matcher.is_terminated())

    def allowed(self) -> np.ndarray:
        self._bitmask.fill(0)
        self.matcher.fill_next_token_bitmask(self._bitmask)
        bits = np.unpackbits(self._bitmask.view(np.uint8), bitorder="little")
        mask = bits[: self.vocab_size].astype(bool)
        if self.never is not None:
            mask &= ~self.never
        return mask

    def accept(self, token: int) -> None:
        if not self.matcher.accept_token(int(token)):
            raise ValueError(f"token {token} is not allowed here")
