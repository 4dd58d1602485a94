"""JSON-constrained sampling (response_format json_object / json_schema) by a token mask of our
own: a character-level JSON recognizer (a pushdown automaton whose state is an immutable tuple
of frames) decides, before each token, which tokens of the vocabulary keep the text a prefix
of valid JSON (and of the schema); `JsonGrammar.allowed()` is that mask.

Why not xgrammar: its wheel requires torch, transformers and triton (triton and transformers are
large installs, and transformers is imported with xgrammar), too much for a fresh CI machine;
this recognizer needs nothing. A mask walks the vocabulary once per parser state (memoized);
inside a plain string the tokens free of quotes, backslashes and control characters are
allowed without a walk.

What it accepts: compact JSON (no whitespace outside strings), a top-level object. A schema may
use: type (one or a list of object, array, string, number, integer, boolean, null), properties
(the object then holds only those keys, each at most once), required, items, enum and const
(any JSON values, matched literally in compact form); annotations (title, description,
$schema, default, examples, strict) are ignored. Other keywords ($ref, anyOf, pattern, ...)
are refused with GrammarError naming them.
"""

from __future__ import annotations

import json

import numpy as np

TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")
_ANNOTATIONS = {"title", "description", "$schema", "default", "examples", "strict", "$id", "$comment",
                "additionalProperties"}
_KEYWORDS = {"type", "properties", "required", "items", "enum", "const"}
_MASK_MEMO = 4096


class GrammarError(ValueError):
    """A schema this recognizer does not support."""


class Schema:
    """A compiled schema node (compared by identity)."""

    __slots__ = ("types", "props", "required", "items", "literals")

    def __init__(self, types=None, props=None, required=frozenset(), items=None, literals=None):
        self.types = types  # frozenset of TYPES, or None (any value)
        self.props = props  # dict key -> Schema, or None (any keys)
        self.required = required
        self.items = items
        self.literals = literals  # tuple of compact JSON texts (enum / const), or None

    def allows(self, kind: str) -> bool:
        return self.types is None or kind in self.types or (kind == "integer" and "number" in self.types)


ANY = Schema()


def compile_schema(schema, where: str = "schema") -> Schema:
    if schema is True or schema == {}:
        return ANY
    if not isinstance(schema, dict):
        raise GrammarError(f"{where} must be an object")
    unknown = sorted(set(schema) - _KEYWORDS - _ANNOTATIONS)
    if unknown:
        raise GrammarError(f"{where}: unsupported keyword(s) {', '.join(unknown)} (supported: type, properties, "
                           f"required, items, enum, const)")
    literals = None
    if "const" in schema:
        literals = (json.dumps(schema["const"], separators=(",", ":")),)
    elif "enum" in schema:
        if not isinstance(schema["enum"], list) or not schema["enum"]:
            raise GrammarError(f"{where}.enum must be a non-empty list")
        literals = tuple(json.dumps(v, separators=(",", ":")) for v in schema["enum"])
    types = schema.get("type")
    if types is not None:
        types = [types] if isinstance(types, str) else types
        if not isinstance(types, list) or not all(t in TYPES for t in types):
            raise GrammarError(f"{where}.type must be one of {', '.join(TYPES)} (or a list of them)")
        types = frozenset(types)
    props = None
    if "properties" in schema:
        if not isinstance(schema["properties"], dict):
            raise GrammarError(f"{where}.properties must be an object")
        props = {k: compile_schema(v, f"{where}.properties.{k}") for k, v in schema["properties"].items()}
    required = schema.get("required", [])
    if not isinstance(required, list) or not all(isinstance(k, str) for k in required):
        raise GrammarError(f"{where}.required must be a list of strings")
    if props is not None and set(required) - set(props):
        raise GrammarError(f"{where}.required names keys without properties: {sorted(set(required) - set(props))}")
    items = compile_schema(schema["items"], f"{where}.items") if "items" in schema else ANY
    return Schema(types, props, frozenset(required), items, literals)


# frames (tuples): ("V", schema) a value; ("L", texts, partial) a literal; ("N", integer, state) a
# number; ("S", escape) a string; ("OK", schema, seen, first) a key or '}'; ("K", schema, seen,
# partial, escape) inside a key; ("C", schema, seen, key) ':'; ("OA", schema, seen) ',' or '}';
# ("AF", schema) a first item or ']'; ("AA", schema) ',' or ']'; ("END",) complete.
_NUMBER = {  # state -> {character class (0: zero, D: 1-9, E: e or E, and . + -): next state}
    "sign": {"0": "zero", "D": "int"}, "zero": {".": "dot", "E": "e"},
    "int": {"0": "int", "D": "int", ".": "dot", "E": "e"}, "dot": {"0": "frac", "D": "frac"},
    "frac": {"0": "frac", "D": "frac", "E": "e"}, "e": {"+": "esign", "-": "esign", "0": "exp", "D": "exp"},
    "esign": {"0": "exp", "D": "exp"}, "exp": {"0": "exp", "D": "exp"}}
_NUMBER_DONE = {"zero", "int", "frac", "exp"}
_HEX = set("0123456789abcdefABCDEF")


def _number_class(ch: str) -> str:
    if ch == "0":
        return "0"
    if "1" <= ch <= "9":
        return "D"
    if ch in "eE":
        return "E"
    return ch if ch in ".+-" else "?"


def _keys_left(schema: Schema, seen: frozenset) -> list[str] | None:
    return None if schema.props is None else [k for k in schema.props if k not in seen]


def step(stack: tuple, ch: str) -> tuple | None:
    """The recognizer's state after one more character (None: the text is no JSON prefix)."""
    top, rest = stack[-1], stack[:-1]
    kind = top[0]
    if kind == "V":
        s = top[1]
        if s.literals is not None:
            return step(rest + (("L", s.literals, ""),), ch)
        if ch == "{" and s.allows("object"):
            return rest + (("OK", s, frozenset(), True),)
        if ch == "[" and s.allows("array"):
            return rest + (("AF", s),)
        if ch == '"' and s.allows("string"):
            return rest + (("S", 0),)
        if (ch == "-" or "0" <= ch <= "9") and (s.allows("number") or s.allows("integer")):
            integer = not (s.types is None or "number" in s.types)
            return rest + (("N", integer, "sign" if ch == "-" else ("zero" if ch == "0" else "int")),)
        for word, typ in (("true", "boolean"), ("false", "boolean"), ("null", "null")):
            if ch == word[0] and s.allows(typ):
                return rest + (("L", (word,), ch),)
        return None
    if kind == "L":
        texts, partial = top[1], top[2]
        new = partial + ch
        longer = [t for t in texts if t.startswith(new)]
        if longer:
            if new in texts and len(longer) == 1:
                return rest  # complete, and nothing longer could follow
            return rest + (("L", texts, new),)
        if partial in texts:
            return step(rest, ch)
        return None
    if kind == "S":
        escape = top[1]
        if escape == 0:
            if ch == '"':
                return rest
            if ch == "\\":
                return rest + (("S", 1),)
            return None if ord(ch) < 0x20 else stack
        if escape == 1:
            if ch in '"\\/bfnrt':
                return rest + (("S", 0),)
            return rest + (("S", 2),) if ch == "u" else None
        if ch not in _HEX:
            return None
        return rest + (("S", 0 if escape == 5 else escape + 1),)
    if kind == "N":
        integer, state = top[1], top[2]
        cls = _number_class(ch)
        following = _NUMBER[state].get(cls)
        if following is not None and not (integer and cls in ".E"):
            return rest + (("N", integer, following),)
        if state in _NUMBER_DONE:
            return step(rest, ch)
        return None
    if kind == "OK":
        s, seen, first = top[1], top[2], top[3]
        if ch == "}" and first and s.required <= seen:
            return rest
        if ch == '"':
            left = _keys_left(s, seen)
            if left is not None and not left:
                return None
            return rest + (("K", s, seen, "" if left is not None else None, 0),)
        return None
    if kind == "K":
        s, seen, partial, escape = top[1], top[2], top[3], top[4]
        if partial is None:  # any key: a string
            inner = step((("S", escape),), ch)
            if inner is None:
                return None
            if inner == ():
                return rest + (("C", s, seen, None),)
            return rest + (("K", s, seen, None, inner[0][1]),)
        left = _keys_left(s, seen)
        if ch == '"':
            return rest + (("C", s, seen | {partial}, partial),) if partial in left else None
        new = partial + ch
        if ch == "\\" or ord(ch) < 0x20 or not any(k.startswith(new) for k in left):
            return None
        return rest + (("K", s, seen, new, 0),)
    if kind == "C":
        if ch != ":":
            return None
        s, seen, key = top[1], top[2], top[3]
        value = ANY if key is None or s.props is None else s.props[key]
        return rest + (("OA", s, seen), ("V", value))
    if kind == "OA":
        s, seen = top[1], top[2]
        if ch == "}" and s.required <= seen:
            return rest
        if ch == ",":
            left = _keys_left(s, seen)
            return rest + (("OK", s, seen, False),) if left is None or left else None
        return None
    if kind == "AF":
        if ch == "]":
            return rest
        return step(rest + (("AA", top[1]), ("V", top[1].items or ANY)), ch)
    if kind == "AA":
        if ch == "]":
            return rest
        return rest + (("AA", top[1]), ("V", top[1].items or ANY)) if ch == "," else None
    return None  # END: nothing may follow


def feed(stack: tuple | None, text: str) -> tuple | None:
    for ch in text:
        if stack is None:
            return None
        stack = step(stack, ch)
    return stack


def token_strings(tokenizer, vocab_size: int) -> "TokenTable":
    """The text of every token (None for special tokens and partial UTF-8 sequences, which
    constrained sampling never picks)."""
    texts: list[str | None] = []
    for token in range(vocab_size):
        text = tokenizer.decode([token]) if tokenizer is not None else ""
        texts.append(text if text and "\ufffd" not in text else None)
    return TokenTable(texts)


class TokenTable:
    """Token texts, and the mask of those a plain string may hold whole (no quote, backslash
    or control character): inside a string they are allowed without a walk."""

    def __init__(self, texts: list[str | None]):
        self.texts = texts
        self.plain = np.array([t is not None and '"' not in t and "\\" not in t and all(ord(c) >= 0x20 for c in t)
                               for t in texts], dtype=bool)
        self.other = [i for i, t in enumerate(texts) if t is not None and not self.plain[i]]
        self.masks: dict[tuple, np.ndarray] = {}


class JsonGrammar:
    """The state of one request's JSON text: allowed() -> bool [vocab] mask of the tokens that
    keep it a valid prefix; accept(token) advances it; done: the top-level value is complete."""

    def __init__(self, table: TokenTable, schema: dict | None = None):
        root = compile_schema(schema) if schema is not None else Schema(frozenset({"object"}))
        if root.types is not None and root.types != frozenset({"object"}):
            raise GrammarError("the schema's top level must be an object (type: object)")
        if root.types is None:
            root = Schema(frozenset({"object"}), root.props, root.required, root.items, root.literals)
        self.table = table
        self.stack: tuple = (("END",), ("V", root))

    @property
    def done(self) -> bool:
        return self.stack == (("END",),)

    def allowed(self) -> np.ndarray:
        memo = self.table.masks
        mask = memo.get(self.stack)
        if mask is not None:
            return mask
        texts = self.table.texts
        if self.stack[-1] == ("S", 0):
            mask = self.table.plain.copy()
            candidates = self.table.other
        else:
            mask = np.zeros(len(texts), dtype=bool)
            candidates = (i for i, t in enumerate(texts) if t is not None)
        for i in candidates:
            if feed(self.stack, texts[i]) is not None:
                mask[i] = True
        if len(memo) >= _MASK_MEMO:
            memo.clear()
        memo[self.stack] = mask
        return mask

    def accept(self, token: int) -> None:
        text = self.table.texts[token]
        state = feed(self.stack, text) if text is not None else None
        if state is None:
            raise ValueError(f"token {token} ({text!r}) is not allowed here")
        self.stack = state
