"""Specification of JSON-constrained sampling (tvmattn.serve.grammar, on xgrammar) over the tiny
model's byte-level BPE vocabulary: every text built by picking allowed tokens at random is
valid JSON once the grammar says it is done, and follows its schema as an independent
validator (jsonschema) reads it, for schemas with anyOf, $ref, pattern, enum, const and bounds;
tokens that would break it are masked; bad schemas, or no xgrammar, are clear errors."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

from test_weights import write_tiny_gguf  # noqa: E402
from tvmattn.serve.grammar import GrammarError, JsonGrammars  # noqa: E402
from tvmattn.weights import tokenizer_from_gguf  # noqa: E402

VOCAB = 268

SCHEMAS = {
    "properties, enum, array of numbers": {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]},
                       "count": {"type": "integer", "minimum": 0, "maximum": 99},
                       "tags": {"type": "array", "items": {"type": "number"}, "maxItems": 3}},
        "required": ["ok", "color", "count"]},
    "anyOf and $ref": {
        "type": "object",
        "$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                            "required": ["x", "y"]}},
        "properties": {"shape": {"anyOf": [{"$ref": "#/$defs/point"}, {"type": "null"},
                                           {"type": "string", "maxLength": 4}]},
                       "kind": {"const": "pt"}},
        "required": ["shape", "kind"]},
    "pattern and bounded strings": {
        "type": "object",
        "properties": {"code": {"type": "string", "pattern": "^[a-c]{2,4}-[0-9]$"},
                       "name": {"type": "string", "minLength": 1, "maxLength": 6}},
        "required": ["code", "name"]},
    "a top-level array": {"type": "array", "items": {"enum": [1, "two", None]}, "minItems": 1, "maxItems": 4},
}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("grammar") / "tiny.gguf"
    write_tiny_gguf(path, np.random.default_rng(7))
    return tokenizer_from_gguf(path)


@pytest.fixture(scope="module")
def grammars(tokenizer):
    return JsonGrammars(tokenizer, VOCAB, stop_ids=[2])


def walk(grammar, tokenizer, rng, steps: int = 800) -> list[int]:
    """Pick allowed tokens at random (closing punctuation favoured, so that walks end)."""
    chosen = []
    for _ in range(steps):
        if grammar.done:
            return chosen
        mask = grammar.allowed()
        assert mask.shape == (VOCAB,) and mask.dtype == bool
        allowed = np.flatnonzero(mask)
        assert allowed.size, f"no token continues {tokenizer.decode(chosen)!r}"
        texts = [tokenizer.decode([int(t)]) for t in allowed]
        weights = np.array([30.0 if any(c in t for c in '"}],') else 1.0 for t in texts])
        token = int(rng.choice(allowed, p=weights / weights.sum()))
        grammar.accept(token)
        chosen.append(token)
    return chosen


@pytest.mark.parametrize("name", sorted(SCHEMAS))
@pytest.mark.parametrize("seed", range(4))
def test_random_walks_under_a_schema_give_json_that_follows_it(grammars, tokenizer, name, seed):
    schema = SCHEMAS[name]
    grammar = grammars.matcher(grammars.compile(schema))
    tokens = walk(grammar, tokenizer, np.random.default_rng(seed))
    text = tokenizer.decode(tokens)
    assert grammar.done, text
    jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("seed", range(4))
def test_json_object_walks_give_an_object(grammars, tokenizer, seed):
    grammar = grammars.matcher(grammars.compile(None))
    text = tokenizer.decode(walk(grammar, tokenizer, np.random.default_rng(100 + seed)))
    assert grammar.done and isinstance(json.loads(text), dict), text


def test_the_mask_refuses_what_breaks_the_schema(grammars, tokenizer):
    grammar = grammars.matcher(grammars.compile(SCHEMAS["properties, enum, array of numbers"]))
    first = {tokenizer.decode([int(t)]) for t in np.flatnonzero(grammar.allowed())}
    assert first and all(t.startswith("{") for t in first), first
    assert not grammar.done
    for piece in '{"ok": true, "color": "':
        grammar.accept(tokenizer.token_to_id(piece) if tokenizer.token_to_id(piece) is not None
                       else tokenizer.encode(piece).ids[0])
    allowed = {tokenizer.decode([int(t)]) for t in np.flatnonzero(grammar.allowed())}
    assert allowed <= {"r", "g", "b", "re", "gr", "bl", "red", "green", "blue"} and {"r", "g", "b"} & allowed
    refused = next(i for i in range(VOCAB) if tokenizer.decode([i]) == "x")
    with pytest.raises(ValueError, match="not allowed"):
        grammar.accept(refused)


@pytest.mark.parametrize("schema, message", [
    ({"type": "nonsense"}, "nonsense"),
    ({"$ref": "#/$defs/missing"}, "missing"),
    ({"type": "string", "pattern": "("}, "parenthesis"),
])
def test_schemas_that_cannot_compile_are_clear_errors(grammars, schema, message):
    with pytest.raises(GrammarError, match=message) as error:
        grammars.compile(schema)
    assert "cannot be compiled" in str(error.value) and ".cc:" not in str(error.value)


def test_without_xgrammar_the_error_says_how_to_install_it(tokenizer, monkeypatch):
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # import xgrammar raises ImportError
    with pytest.raises(GrammarError, match=r"tvmattn\[serve\]"):
        JsonGrammars(tokenizer, VOCAB)


def test_no_raw_control_character_enters_a_length_bounded_string(grammars, tokenizer):
    # xgrammar's maxLength strings admit raw control characters, which JSON forbids
    grammar = grammars.matcher(grammars.compile({"type": "object", "properties": {"s": {"type": "string",
                                                                                        "maxLength": 4}},
                                                 "required": ["s"]}))
    for token in tokenizer.encode('{"s": "').ids:
        grammar.accept(token)
    allowed = np.flatnonzero(grammar.allowed())
    assert tokenizer.token_to_id("a") in allowed
    assert not [t for t in allowed if any(ord(c) < 0x20 for c in tokenizer.decode([int(t)]))]
