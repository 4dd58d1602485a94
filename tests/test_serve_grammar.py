"""Specification of the JSON token mask (tvmattn.serve.grammar): every text built by picking
allowed tokens at random is a prefix of valid JSON following the schema, and once complete it
parses (json.loads) and follows the schema; tokens that would break it are masked."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tvmattn.serve.grammar import GrammarError, JsonGrammar, TokenTable

# a toy vocabulary: JSON punctuation, pieces of keys and words, digits, escapes, multi-character tokens
VOCAB = ['{', '}', '[', ']', ',', ':', '"', '{"', '":', '",', '"}', '"]', 'ok', 'color', 'name', 'tags', 'count',
         'true', 'false', 'null', 'tr', 'ue', 'fa', 'lse', 'nu', 'll', 'red', 'green', 'blue', 're', 'd', 'a', 'b',
         ' ', 'hello', '\\', '\\n', '0', '1', '7', '-', '.', '+', '12', '3.5', '"x"', '\n', None]
# every single letter too, as in a byte-level vocabulary: any valid prefix can then be completed
VOCAB += [c for c in "abcdefghijklmnopqrstuvwxyz" if c not in VOCAB]
TABLE = TokenTable(VOCAB)

SCHEMA = {"type": "object",
          "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]},
                         "name": {"type": "string"}, "count": {"type": "integer"},
                         "tags": {"type": "array", "items": {"type": "number"}}},
          "required": ["ok", "color"]}


def follows(value, schema) -> bool:
    """A small independent checker for the keywords SCHEMA uses."""
    if "enum" in schema:
        return value in schema["enum"]
    kind = schema.get("type")
    checks = {"boolean": lambda v: isinstance(v, bool), "string": lambda v: isinstance(v, str),
              "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
              "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
              "array": lambda v: isinstance(v, list), "object": lambda v: isinstance(v, dict)}
    if kind and not checks[kind](value):
        return False
    if kind == "object" and "properties" in schema:
        return (set(value) <= set(schema["properties"]) and set(schema.get("required", [])) <= set(value)
                and all(follows(v, schema["properties"][k]) for k, v in value.items()))
    if kind == "array" and "items" in schema:
        return all(follows(v, schema["items"]) for v in value)
    return True


def walk(grammar: JsonGrammar, rng, steps: int = 400) -> str:
    text = ""
    for _ in range(steps):
        if grammar.done:
            return text
        mask = grammar.allowed()
        assert mask.any(), f"no token continues {text!r}"
        allowed = np.flatnonzero(mask)
        # favour closing punctuation so that walks end
        weights = np.array([4.0 if VOCAB[i] in ('}', ']', '"', '"}', '",', ',', '":') else 1.0 for i in allowed])
        token = int(rng.choice(allowed, p=weights / weights.sum()))
        grammar.accept(token)
        text += VOCAB[token]
    return text


@pytest.mark.parametrize("seed", range(12))
def test_random_walks_under_the_schema_mask_give_json_that_follows_it(seed):
    rng = np.random.default_rng(seed)
    grammar = JsonGrammar(TABLE, SCHEMA)
    text = walk(grammar, rng)
    assert grammar.done, text
    value = json.loads(text)
    assert follows(value, SCHEMA), text


@pytest.mark.parametrize("seed", range(8))
def test_random_walks_under_json_object_give_an_object(seed):
    rng = np.random.default_rng(100 + seed)
    grammar = JsonGrammar(TABLE)
    text = walk(grammar, rng)
    assert grammar.done, text
    assert isinstance(json.loads(text), dict), text


def test_mask_refuses_what_breaks_json_or_the_schema():
    grammar = JsonGrammar(TABLE, SCHEMA)
    allowed = {VOCAB[i] for i in np.flatnonzero(grammar.allowed())}
    assert allowed == {'{', '{"'}  # a top-level object, no whitespace
    for token in ('{"', 'co', 'lor'):
        if token in VOCAB:
            grammar.accept(VOCAB.index(token))
    allowed = {VOCAB[i] for i in np.flatnonzero(grammar.allowed())}
    assert 'color' in allowed and 'ok' in allowed and 'hello' not in allowed and '}' not in allowed
    assert None not in allowed


def test_unsupported_schemas_are_refused():
    with pytest.raises(GrammarError, match="anyOf"):
        JsonGrammar(TABLE, {"anyOf": [{"type": "string"}]})
    with pytest.raises(GrammarError, match="top level"):
        JsonGrammar(TABLE, {"type": "array"})
    with pytest.raises(GrammarError, match="required"):
        JsonGrammar(TABLE, {"type": "object", "properties": {"a": {}}, "required": ["b"]})
